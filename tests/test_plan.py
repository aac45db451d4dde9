"""`plan(path, options)`: one set of decisions for `sluice.load` and `sluice inspect`. What inspect prints is what
load builds, for every option that changes a decision, and a budget that cannot work is the same BudgetError from
both, raised before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from sluice import cli
from sluice.errors import BudgetError
from sluice.host.memory import MemoryRoom
from sluice.options import LoadOptions
from sluice.plan import plan
from sluice.store.budget import RUNTIME_RESERVE

from .models.tiny import hf_model, write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("plan"), "per_expert")


@pytest.fixture(scope="module")
def sizes(model_dir) -> dict:
    p = plan(model_dir, LoadOptions.make(memory="all"))
    return {"resident": p.resident_bytes, "expert": p.layout.expert_nbytes, "kv": p.kv_bytes, "top_k": p.spec.top_k}


def _room(monkeypatch, nbytes: int) -> None:
    """The room the plan sees, nothing held yet (the whole RUNTIME_RESERVE still to come)."""
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(nbytes, "cgroup /test limit"))
    real = sluice.plan.memory_status
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {**real(), "rss_anon_bytes": 0})


def _flags(options: dict) -> list[str]:
    out = []
    for k, v in options.items():
        if isinstance(v, bool):
            out.append(f"--{'' if v else 'no-'}{k}")
        else:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def inspect(model_dir, options: dict, capsys) -> dict:
    assert cli.main(["inspect", str(model_dir), "--json", "--usage-tokens", "0", *_flags(options)]) == 0
    return json.loads(capsys.readouterr().out)


GiB = 2**30
# case -> sizes -> (options, the room this process may take)
CASES = {
    "resident": lambda s: ({"memory": "all"}, 16 * GiB),
    # the room left beside the budget holds one expert: O_DIRECT (page cache could not hold the experts anyway)
    "budget": lambda s: ({"memory": s["resident"] + 5 * s["expert"], "io": "direct"},
                         s["resident"] + 6 * s["expert"] + s["kv"] + RUNTIME_RESERVE),
    "auto streams": lambda s: ({"memory": "auto"},
                               RUNTIME_RESERVE + s["kv"] + s["resident"] + 3 * s["expert"] + s["expert"] // 2),
    "float32, lazy rows, short context, odirect": lambda s: (
        {"memory": 2 * s["resident"] + 4 * 2 * s["expert"], "dtype": "float32", "embeddings": "mmap",
         "max_context": 64, "odirect": True, "threads": 1}, 16 * GiB),
}


@pytest.mark.parametrize("case", CASES)
def test_inspect_and_load_agree_on_every_decision(model_dir, sizes, monkeypatch, capsys, case):
    options, room = CASES[case](sizes)
    _room(monkeypatch, room)
    info = inspect(model_dir, options, capsys)
    threads = torch.get_num_threads()
    try:
        with sluice.load(model_dir, **options) as m:
            st = m.stats()
            got = {"resident_bytes": m.resident_bytes, "compute_dtype": st["dtype"], "memory": m.memory,
                   "memory_plan": st["memory_plan"], "expert_slots": st.get("slots"), "odirect": m.odirect,
                   "kv_cache_bytes": m.cache.nbytes, "max_context": m.cache.max_context, "threads": st["threads"],
                   "prefill_chunk": m.prefill_chunk}
    finally:
        torch.set_num_threads(threads)
    assert {k: info.get(k) for k in got} == got
    expected = {"resident": {"memory": None, "odirect": False}, "budget": {"expert_slots": 5, "odirect": True},
                "auto streams": {"expert_slots": 3},
                "float32, lazy rows, short context, odirect": {"compute_dtype": "float32", "max_context": 64,
                                                               "odirect": True, "threads": 1}}[case]
    assert {k: got[k] for k in expected} == expected  # the cases do reach the decisions they are named after


@pytest.mark.parametrize("too_small", ["budget", "room"])
def test_a_budget_that_cannot_work_is_the_same_error_from_both_before_any_weight(model_dir, sizes, monkeypatch,
                                                                                  capsys, too_small):
    s = sizes
    if too_small == "budget":  # one slot short of one layer's top_k
        options = {"memory": s["resident"] + (s["top_k"] - 1) * s["expert"]}
    else:  # --memory auto in a room that cannot hold one layer
        _room(monkeypatch, RUNTIME_RESERVE)
        options = {"memory": "auto"}
    with pytest.raises(BudgetError) as planned:
        plan(model_dir, LoadOptions.make(**options))

    def no_weights(*a, **k):
        raise AssertionError("weights were read before the budget was checked")

    monkeypatch.setattr("sluice.engine.load_resident", no_weights)
    with pytest.raises(BudgetError) as loaded:
        sluice.load(model_dir, **options)
    assert str(loaded.value) == str(planned.value)
    assert cli.main(["inspect", str(model_dir), "--json", "--usage-tokens", "0", *_flags(options)]) == 2
    assert str(planned.value) in capsys.readouterr().err


@pytest.mark.parametrize("qtype,want", [("Q2_K", "int8"), ("IQ2_XXS", "int8"), ("Q4_K", "int8"), ("Q6_K", "int16"),
                                        ("Q8_0", "int16"), ("F32", "int16")])
def test_auto_activations_code_int8_only_for_experts_under_five_and_a_half_bits(tmp_path, qtype, want):
    """`--activations auto` (the default): int8 where the experts' own rounding dwarfs int8's coding (< 5.5 bits
    per weight), int16 elsewhere; inspect and the loaded model's kernels agree, and an explicit choice is kept."""
    from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert
    from tests.quant.test_gguf_models import K_SHAPES

    model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **K_SHAPES})
    path = convert(model, tmp_path / "m.gguf", qtype=lambda name: Q[qtype] if "_exps." in name else Q.F32)
    p = plan(path, LoadOptions.make(memory="all"))
    assert (p.activations, p.activations_why.startswith("auto: experts ")) == (want, True)
    with sluice.load(path, memory="all") as m:
        assert m.compute.planes == {"int8": 1, "int16": 2}[want]
    other = "int16" if want == "int8" else "int8"
    assert plan(path, LoadOptions.make(memory="all", activations=other)).activations == other



def test_prefetch_is_auto_where_the_direct_reader_streams_and_inspect_says_so(model_dir, sizes, capsys):
    """A decode token's read-ahead: `auto` by default where experts stream through the direct reader (the router's
    guesses, throttled: its store's throttle is AUTO_THROTTLE), none where everything is resident or the reader is the
    mapping (auto only; an explicit mode is as asked); inspect prints the decision and the loaded model builds it."""
    from sluice.store.prefetch import AUTO_THROTTLE, ROUTER_THROTTLE

    streamed = sizes["resident"] + 2 * sizes["top_k"] * sizes["expert"] + sizes["kv"]
    auto = plan(model_dir, LoadOptions.make(memory=streamed))
    assert auto.prefetch == "auto" and "80%" in auto.prefetch_why
    assert plan(model_dir, LoadOptions.make(memory="all", prefetch="router")).prefetch_why == "everything resident"
    assert plan(model_dir, LoadOptions.make(memory="all")).prefetch == "none"
    mapped = plan(model_dir, LoadOptions.make(memory=streamed, io="mmap"))
    assert mapped.prefetch == "none" and "--io mmap" in mapped.prefetch_why
    asked = plan(model_dir, LoadOptions.make(memory=streamed, io="mmap", prefetch="router"))
    assert (asked.prefetch, asked.prefetch_why) == ("router", "as asked")
    assert plan(model_dir, LoadOptions.make(memory=streamed, prefetch="none")).prefetch == "none"
    with sluice.load(model_dir, memory=streamed, prefetch="none") as m:
        assert m.model.prerouter is None
    with sluice.load(model_dir, memory=streamed) as m:
        assert m.model.prerouter is not None and m.store.prefetching.throttle == AUTO_THROTTLE
    with sluice.load(model_dir, memory=streamed, prefetch="router") as m:
        assert m.model.prerouter is not None and m.store.prefetching.throttle == ROUTER_THROTTLE
    assert cli.main(["inspect", str(model_dir), "--usage-tokens", "0", "--memory", str(streamed), "--prefetch",
                     "router"]) == 0
    assert "decode read-ahead: router (as asked)" in capsys.readouterr().out
    assert cli.main(["inspect", str(model_dir), "--usage-tokens", "0", "--memory", str(streamed)]) == 0
    assert "decode read-ahead: auto (the next layer's router guesses" in capsys.readouterr().out


def test_an_explicit_prefill_chunk_shrinks_autos_budget(model_dir, sizes, monkeypatch):
    """`--memory auto` with `--prefill-chunk N`: the chunk's activations (the plan's estimate) come out of the room
    first, so the passes fit beside the slots; an explicit budget that leaves them no room is a BudgetError."""
    from sluice.store.budget import prefill_token_bytes

    total = plan(model_dir, LoadOptions.make(memory="all")).layout.total_experts
    room = sizes["resident"] + (total - 1) * sizes["expert"] + sizes["kv"] + RUNTIME_RESERVE  # streams one short
    _room(monkeypatch, room)
    auto = plan(model_dir, LoadOptions.make(memory="auto"))
    chunked = plan(model_dir, LoadOptions.make(memory="auto", prefill_chunk=16))
    per_token = prefill_token_bytes(auto.spec, 2, auto.max_context)
    assert auto.memory is not None and chunked.memory == auto.memory - 16 * per_token
    assert "for --prefill-chunk's passes" in chunked.memory_plan.describe()
    with pytest.raises(BudgetError, match="--prefill-chunk's passes"):
        plan(model_dir, LoadOptions.make(memory=auto.memory, prefill_chunk=4096))
