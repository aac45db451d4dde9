"""Seeded fuzz of the GGUF reader and index: thousands of mutated headers (bit flips, bytes, u32/u64 fields set to
edge values, truncations, insertions, deletions, appended bytes) end in a SluiceError or in a file whose every tensor
and metadata value agree with gguf.GGUFReader's; nothing else escapes and nothing hangs."""

from __future__ import annotations

import math
import os
import random
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from sluice.checkpoint.gguf import read_gguf
from sluice.errors import SluiceError
from tests.checkpoint.gguf_files import Q, add, gguf
from sluice.plan import open_index

U64 = [0, 1, 2, 3, 31, 32, 33, 64, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63,
       2**64 - 1]
U32 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 30, 31, 39, 41, 64, 2**31, 2**32 - 1]


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reader_file(path: Path) -> bytes:
    """Every metadata type and a few tensor types, small enough to rewrite thousands of times."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_custom_alignment(64)
    w.add_uint32("qwen3moe.block_count", 1)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_bool("x.flag", False)
    w.add_int64("x.i64", -5)
    w.add_float64("x.f64", 0.25)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "<|x|>"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.0])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_string("tokenizer.chat_template", "{{ x }}")
    add(w, "a", rng.standard_normal(16).astype(np.float32))
    add(w, "b", rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0)
    add(w, "c", rng.standard_normal((1, 256)).astype(np.float32), Q.Q4_K)
    add(w, "d", rng.standard_normal((2, 32)).astype(np.float32), Q.F16)
    _finish(w)
    return path.read_bytes()


def model_file(path: Path) -> bytes:
    """A complete one-layer qwen3moe model, tiny: exercises the config mapping and the name mapping too."""
    rng = np.random.default_rng(1)
    H, I, E, V, heads, D = 32, 32, 2, 8, 2, 16
    w = gguf.GGUFWriter(path, "qwen3moe")
    for adder, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, H),
                         (w.add_feed_forward_length, 64), (w.add_head_count, heads), (w.add_head_count_kv, 1),
                         (w.add_key_length, D), (w.add_value_length, D), (w.add_rope_freq_base, 1e6),
                         (w.add_layer_norm_rms_eps, 1e-6), (w.add_expert_count, E), (w.add_expert_used_count, 1),
                         (w.add_expert_feed_forward_length, I), (w.add_bos_token_id, 0), (w.add_eos_token_id, 1)):
        adder(value)
    w.add_token_list([f"t{i}" for i in range(V)])
    shapes = {"token_embd.weight": (V, H), "blk.0.attn_norm.weight": (H,), "blk.0.attn_q.weight": (heads * D, H),
              "blk.0.attn_k.weight": (D, H), "blk.0.attn_v.weight": (D, H), "blk.0.attn_output.weight": (H, heads * D),
              "blk.0.attn_q_norm.weight": (D,), "blk.0.attn_k_norm.weight": (D,), "blk.0.ffn_norm.weight": (H,),
              "blk.0.ffn_gate_inp.weight": (E, H), "blk.0.ffn_gate_exps.weight": (E, I, H),
              "blk.0.ffn_up_exps.weight": (E, I, H), "blk.0.ffn_down_exps.weight": (E, H, I),
              "output_norm.weight": (H,)}
    for name, shape in shapes.items():
        add(w, name, rng.standard_normal(shape).astype(np.float32), Q.Q8_0 if "exps" in name else None)
    _finish(w)
    return path.read_bytes()


def mutate(raw: bytes, rng: random.Random, header: int) -> bytes:
    b = bytearray(raw)
    span = header if rng.random() < 0.9 else len(b)  # mostly the header, where the structure is
    op = rng.randrange(8)
    at = rng.randrange(span)
    if op == 0:
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(span)
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        b[at] = rng.randrange(256)
    elif op == 2 and at + 8 <= len(b):
        b[at:at + 8] = struct.pack("<Q", rng.choice(U64 + [len(b), len(b) - at, rng.getrandbits(64)]))
    elif op == 3 and at + 4 <= len(b):
        b[at:at + 4] = struct.pack("<I", rng.choice(U32))
    elif op == 4:
        del b[rng.randrange(len(b)):]
    elif op == 5:
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif op == 6:
        del b[at:at + rng.randint(1, 16)]
    else:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(b)


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def assert_agrees_with_gguf_reader(path: Path) -> None:
    ours = read_gguf(path)
    try:
        ref = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 (any refusal by the reference is a disagreement to report)
        pytest.fail(f"sluice accepted a file gguf.GGUFReader refuses ({type(e).__name__}: {e})")
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        r = ours.tensors[t.name]
        assert (r.offset, r.nbytes, r.dtype) == (t.data_offset, t.n_bytes, t.tensor_type.name)
        assert r.shape == tuple(int(d) for d in reversed(t.shape))
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(ours.metadata)
    for key, field in fields.items():
        nested = ours.types[key] == 9 and ours.array_types.get(key) == 9
        if not nested:  # gguf-py flattens nested arrays
            assert _same(ours.metadata[key], field.contents()), key


@pytest.mark.parametrize("kind,cases,opener", [("reader", 2500, "read_gguf"), ("model", 700, "index")])
def test_fuzzed_headers(tmp_path, kind, cases, opener):
    base_path = tmp_path / "base.gguf"
    base = reader_file(base_path) if kind == "reader" else model_file(base_path)
    header = read_gguf(base_path).data_start
    if opener == "index":
        open_index(base_path)  # the unmutated file is a valid model
    rng = random.Random(f"gguf-fuzz-{kind}")
    path = tmp_path / "fuzz.gguf"
    # rewritten in place, then cut to length: creating or emptying the file each time costs ~5 ms here (ext4 flushes
    # a file truncated to 0), the whole loop ~0.1 ms
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    accepted, slowest = 0, 0.0
    for case in range(cases):
        raw = mutate(base, rng, header)
        os.pwrite(fd, raw, 0)
        os.ftruncate(fd, len(raw))
        t0 = time.perf_counter()
        try:
            if opener == "index":
                open_index(path)
            else:
                read_gguf(path)
        except SluiceError:
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"case {case}: {type(e).__name__} escaped: {e}")
        finally:
            slowest = max(slowest, time.perf_counter() - t0)
        accepted += 1
        assert_agrees_with_gguf_reader(path)
    os.close(fd)
    assert slowest < 2.0, f"one header took {slowest:.2f} s"  # a hang or a huge allocation would show here
    assert 0 < accepted < cases  # both outcomes are exercised
