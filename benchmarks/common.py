"""What the scripts under benchmarks/ share: the models they default to, a seeded prompt, `with_kernels`, the one
place that knows where each kernel / scheduling choice they compare lives, and `decode_logits`.

The scripts import it after putting benchmarks/ on sys.path (`sys.path.insert(0, ...)` at their top); their timing
protocol is sluice.bench.timing (alternate, median_ms).

with_kernels: a benchmark compares arms that sluice itself picks once (a switch on the loaded model, a process-wide
setting of the native kernels or the store). Those switches are internals: when they move (issue 29 turns them into
build options), this function changes and the scripts do not; so does decode_logits when the model's forward does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"
# made by benchmarks/quantized/run.sh (the peers model: 16 layers, 64 experts top-8, expert intermediate 512)
PEERS_Q4 = MODELS / "qwen3_moe-peers" / "model-Q4_K_M.gguf"
PEERS_BF16 = MODELS / "qwen3_moe-peers" / "model.gguf"
# made by: sluice make-model benchmarks/models/qwen3_moe-1GiB --from demo --size 1GiB
DEMO_1G = MODELS / "qwen3_moe-1GiB"


def prompt(n: int, seed: int) -> list[int]:
    """n token ids in [3, 1000), seeded: a new prompt per run where a cache must not carry over between arms."""
    import torch

    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_logits(model, prompt: list[int], tokens: list[int]):
    """Logits of each teacher-forced decode step of a loaded sluice Model (the prompt, then one token at a time),
    [len(tokens), V] float32: Model.replay returns only each step's argmax, so this runs the model's transformer
    step by step, the other place (beside with_kernels) that knows the model's insides."""
    import torch

    tm = model.model
    with torch.inference_mode():
        tm.forward(torch.tensor(prompt), 0)
        return torch.cat([tm.logits(tm.forward(torch.tensor([t]), p)) for p, t in enumerate(tokens, len(prompt))])


# choice -> what it sets. Model switches (the loaded Model's transformer): split_experts (a decode step's experts as
# one native call per layer over the threads, False: one expert_q8 call each), native_attention (decode attention
# and router as native calls, False: the torch steps), code_rows_once (int8 prompt: a layer's rows coded once for
# all its experts, False: each expert codes its own). Process-wide: threads (native.set_threads), super_blocks (the
# K-quants read x in super-blocks of 256, False: 32-value blocks), prefetch (the integer row loop's prefetch
# distance in bytes, 0 off), prompt_wait / decode_wait (the C pool's (spin, yield) ns between jobs), read_group
# (experts per read batch of a prompt's read-ahead), gemm_blocks (an expert's prompt rows in row blocks, False: one
# GEMM for all), gemm_row_step (a prompt expert's rows padded to a multiple of this), matmul ("bf16" | "float32":
# how many bf16 rows multiply bf16 weights; set at load from LoadOptions.matmul).
MODEL_SWITCHES = ("split_experts", "native_attention", "code_rows_once")
_GEMM_BLOCKS: tuple[int, int] | None = None  # sluice.matmul's (GEMM_BLOCK_BYTES, GEMM_MIN_BLOCK), read at first use


def _process_switch(name: str) -> tuple[Any, Any]:
    """(getter, setter) of a process-wide choice."""
    global _GEMM_BLOCKS
    from sluice import matmul
    from sluice.models import blocks
    from sluice.quant import native
    from sluice.store import streaming

    if _GEMM_BLOCKS is None:  # sluice.matmul's own values, read before any with_kernels changed them
        _GEMM_BLOCKS = (matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK)

    def attr(module, field):
        return (lambda: getattr(module, field)), (lambda v: setattr(module, field, v))

    def gemm_blocks(on: bool | tuple[int, int]) -> None:  # a tuple: the values a with block puts back
        blocks_ = on if isinstance(on, tuple) else _GEMM_BLOCKS if on else (1 << 40, 1 << 40)
        matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK = blocks_

    def threads() -> int:
        pool = native.shared_pool()
        return pool.threads if pool is not None else 1

    table = {
        "threads": (threads, native.set_threads),
        # no getter in the extension: the documented defaults (native.set_super_blocks, native.set_prefetch)
        "super_blocks": (lambda: True, native.set_super_blocks),
        "prefetch": (lambda: 2048, native.set_prefetch),
        "prompt_wait": attr(native, "PROMPT_WAIT"),
        "decode_wait": attr(native, "DECODE_WAIT"),
        "read_group": attr(streaming, "PROMPT_READ_GROUP"),
        "gemm_blocks": (lambda: (matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK), gemm_blocks),
        "gemm_row_step": attr(blocks, "GEMM_ROW_STEP"),
        "matmul": (lambda: "bf16" if matmul.bf16_gemm() else "float32", matmul.set_matmul),
    }
    if name not in table:
        raise ValueError(f"with_kernels: unknown choice {name!r}; known: {', '.join([*MODEL_SWITCHES, *table])}")
    return table[name]


@contextmanager
def with_kernels(model=None, **choices: Any) -> Iterator[None]:
    """Set `choices` (see MODEL_SWITCHES and _process_switch) for the block, then put back what was there.
    `model`: a loaded sluice Model, for the model switches.

        with with_kernels(m, native_attention=False):
            m.replay(prompt, tokens)
        with with_kernels(threads=1, super_blocks=False):
            call.many(...)
    """
    undo: list[Any] = []
    try:
        for name, value in choices.items():
            if name in MODEL_SWITCHES:
                if model is None:
                    raise ValueError(f"with_kernels: {name} is a switch of a loaded model: pass the model")
                old = getattr(model.model, name)
                setattr(model.model, name, value)
                undo.append(lambda o=old, n=name: setattr(model.model, n, o))
            else:
                get, put = _process_switch(name)
                old = get()
                put(value)
                undo.append(lambda o=old, p=put: p(o))
        yield
    finally:
        for u in reversed(undo):
            u()
