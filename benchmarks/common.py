"""What the scripts under benchmarks/ share: the models they default to, a seeded prompt, the in-process timing
protocol (alternate, alternate_tokens, median_ms, medians), an arm in a fresh process (child_json), `with_kernels` and
`default_compute`, the one place that knows where each kernel / scheduling choice they compare lives,
`decode_logits`, and the process tree under a pid (`processes`, `descendants`: the Ray benchmark's and test's).

The scripts import it as `benchmarks.common` after putting the repository root on sys.path (`sys.path.insert(0, ...)`
at their top); tests/bench/test_timing.py and test_common.py test it. Nothing heavy is imported at this module's top
(torch and sluice where a function needs them): compare.py's transformers child imports it and must run without
sluice.

Timing: the arms of a comparison run in rotated order per round (sluice.bench.protocol.rotation, as `sluice bench`
rotates its children), and a function's time is the median over rounds. `sluice bench` times whole processes; these
time calls inside one process, where a comparison alternates arms so a slow spell of a shared machine lands on all
of them.

    alternate({"a": run_a, "b": run_b}, rounds=4)        # {"a": [result per round], "b": [...]}
    alternate_tokens(m.generate_tokens(...), {"on": on, "off": off}, rounds=16)   # {"on": [ms a token], ...}
    median_ms({"bf16": f, "float32": g}, rounds=15, reps=30)   # {"bf16": ms per call, "float32": ...}

with_kernels: a benchmark compares arms that sluice itself picks once: a model's Kernels (sluice.models.layers.build,
chosen when the model is built: the arm rebuilds it with other ones), or a process-wide setting of the native
kernels or the store. When those move, this function changes and the scripts do not; so does decode_logits when the
model's forward does. A model's own compute settings (matmul mode, activation coding, isa) are its load options: a
comparison of them loads one model per setting, or builds a Compute for kernel-level calls (default_compute).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"
# made by benchmarks/quantized/run.sh (the peers model: 16 layers, 64 experts top-8, expert intermediate 512)
PEERS_Q4 = MODELS / "qwen3_moe-peers" / "model-Q4_K_M.gguf"
PEERS_BF16 = MODELS / "qwen3_moe-peers" / "model.gguf"
# made by: sluice make-model benchmarks/models/qwen3_moe-1GiB --from demo --size 1GiB
DEMO_1G = MODELS / "qwen3_moe-1GiB"

K = TypeVar("K", bound=Hashable)


# -- timing ------------------------------------------------------------------------------------------------------------
def alternate(arms: Mapping[K, Callable[[], Any]], rounds: int,
              report: Callable[[int, K, Any], None] | None = None) -> dict[K, list[Any]]:
    """Call each arm once per round, the arms in rotation()'s order (round r starts at arm r), and collect what
    each returns, in round order. `report(round, arm, result)` after each call (progress lines)."""
    from sluice.bench.protocol import rotation  # here, not at the top: see the module docstring

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(arms)
    out: dict[K, list[Any]] = {k: [] for k in names}
    for r in range(rounds):
        for k in rotation(names, r):
            out[k].append(arms[k]())
            if report is not None:
                report(r, k, out[k][-1])
    return out


def alternate_tokens(tokens: Iterator[Any], arms: Mapping[K, Callable[[], None]], rounds: int,
                     per_arm: int = 16) -> dict[K, list[float]]:
    """An in-process A/B of a setting over one token stream (a model's generate_tokens): each round, each arm in
    alternate's order switches its setting on (arms[k]()), one token runs untimed, then `per_arm` tokens are timed;
    {arm: [ms a token, per round]}. Both arms see the same machine moments and the same model state."""

    def timed(switch: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            switch()
            return timed_tokens(tokens, per_arm)
        return run

    return alternate({k: timed(f) for k, f in arms.items()}, rounds)


def print_paired(res: Mapping[str, list[float]], before: str, after: str, label: str, faster: str) -> None:
    """An A/B's lines (alternate_tokens' {arm: ms a token per round}): each arm's median and min as `label` with the
    arm's name in it ({arm}), then the paired median of before - after and the rounds `after` won ("faster
    {faster}")."""
    for w in (before, after):
        print(f"{label.format(arm=w)}: median {statistics.median(res[w]):.2f} ms/token, min {min(res[w]):.2f}")
    d = [x - y for x, y in zip(res[before], res[after])]
    print(f"paired ({before} - {after}): median {statistics.median(d):+.2f} ms, {sum(x > 0 for x in d)}/{len(d)} "
          f"rounds faster {faster}")


def timed_tokens(tokens: Iterator[Any], n: int = 16) -> float:
    """One token of `tokens` untimed, then ms a token over the next `n` (alternate_tokens' arm; engine_ab.py's, which
    alternates two models' streams)."""
    next(tokens)
    t = time.perf_counter()
    for _ in range(n):
        next(tokens)
    return (time.perf_counter() - t) / n * 1e3


#: the issue-30 model the results/hybrid scripts decode (benchmarks/hybrid/run.sh makes it)
HYBRID_Q4 = "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"


def decode_options(mode: str) -> dict:
    """sluice.load's options of the results scripts' decode modes: "resident", everything in memory; "stream" (or
    "streamed"), the experts streamed at --memory 640MiB, O_DIRECT, no cgroup, each layer's read after its router
    (--prefetch none, the default their outputs before 2026-12-05 measured; --prefetch auto now guesses); "router",
    the same with the next layer's guesses read ahead (--prefetch router); "auto", with the default read-ahead
    (--prefetch auto)."""
    if mode == "resident":
        return dict(memory="all")
    if mode not in ("stream", "streamed", "router", "auto"):
        raise SystemExit(f"mode {mode!r}: resident, stream, router or auto")
    prefetch = mode if mode in ("router", "auto") else "none"
    return dict(memory="640MiB", io="direct", odirect=True, prefetch=prefetch)


def decode_stream(path: str, mode: str, skip: int = 40, **options):
    """(the model loaded for `mode` (decode_options, then `options`), 2 threads, and its greedy stream of up to 1,100
    tokens after [5, 6], the first `skip` taken): the in-process A/B scripts' run (alternate_tokens on it)."""
    import sluice

    m = sluice.load(path, threads=2, max_context=1200, **{**decode_options(mode), **options})
    it = m.generate_tokens([5, 6], max_tokens=1100, temperature=0.0, stop_at_eos=False)
    for _ in range(skip):
        next(it)
    return m, it


def median_ms(fns: Mapping[K, Callable[[], Any]], rounds: int, reps: int = 1, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> dict[K, float]:
    """Milliseconds per call of each function: `warmup` untimed calls of each first, then per round (alternate's
    order) `reps` calls timed together by `clock`, divided by reps; the median over rounds."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for f in fns.values():
        for _ in range(warmup):
            f()

    def timed(f: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            t = clock()
            for _ in range(reps):
                f()
            return 1000 * (clock() - t) / reps
        return run

    times = alternate({k: timed(f) for k, f in fns.items()}, rounds)
    return {k: statistics.median(v) for k, v in times.items()}


def medians(results: Mapping[K, list[float]]) -> dict[K, float]:
    """The median of each arm's results (alternate's output of numbers)."""
    return {k: statistics.median(v) for k, v in results.items()}


def child_json(cmd: list[str], env: dict[str, str] | None = None) -> Any:
    """Run `cmd` (an arm in a fresh process) and return the last line of its stdout as JSON. A child that fails
    ends this script with the last line of its stderr (a missing model: the child's one-line error), not a
    CalledProcessError traceback."""
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise SystemExit(f"{last} (in its child: {Path(cmd[1]).name} {cmd[2]})")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- models and prompts ------------------------------------------------------------------------------------------------
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


def default_compute():
    """The Compute (sluice.quant.compute) of a model loaded with the default options on this CPU (bf16; matmul auto:
    bf16 GEMMs where the CPU has bf16 dot-product instructions; activations int16; every native path), for arms
    that call a weight's kernels without loading a model. Before issue 29 these calls ran on the process-wide
    defaults, which were these."""
    import torch

    from sluice.quant.compute import Compute
    from sluice.quant.matmul import resolve_matmul

    return Compute(dtype=torch.bfloat16, bf16_gemm=resolve_matmul("auto"))


# -- with_kernels ------------------------------------------------------------------------------------------------------
# choice -> what it sets. Model switches, the fields of the loaded model's Kernels (sluice.models.layers.build):
# native_decode (a decode step's attention core and router as native calls, False: the torch steps),
# native_prompt_attention (a prompt's causal attention in attend.c, where the model's Compute allows it),
# split_experts (a decode step's experts as one native call per layer over the threads, False: one expert_q8 call
# each), code_rows_once (int8 prompt: a layer's rows coded once for all its experts, False: each expert codes its
# own), native_deltanet (a Gated DeltaNet layer's decode token in one native call, False: the torch steps),
# native_delta_prompt (a Gated DeltaNet layer's delta rule over a prompt in one native call, False: the torch steps).
# Process-wide: threads (the C pool's, native/pool.py), super_blocks (the K-quants read x in super-blocks of
# 256, False: 32-value blocks), prefetch (the integer row loop's prefetch distance in bytes, 0 off), read_group
# (experts per read batch of a prompt's read-ahead), gemm_blocks (an expert's prompt rows in row blocks, False: one
# GEMM for all), gemm_row_step (a prompt expert's rows padded to a multiple of this).
MODEL_SWITCHES = ("native_decode", "native_prompt_attention", "split_experts", "code_rows_once", "native_deltanet",
                  "native_delta_prompt")
_GEMM_BLOCKS: tuple[int, int] | None = None  # sluice.quant.matmul's (GEMM_BLOCK_BYTES, GEMM_MIN_BLOCK), at first use
# a model's transformer -> {Kernels: that model rebuilt with them}: each arm's model is built once, so what it builds
# lazily (scratch, workspaces, per-format calls) carries over between its rounds, as it does in the default build
_REBUILT: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()


def _process_choice(name: str) -> tuple[Any, Any]:
    """(getter, setter) of a process-wide choice."""
    global _GEMM_BLOCKS
    from sluice.quant import matmul
    from sluice.quant.native import pool, q8
    from sluice.store import streaming

    # the modules, by name: sluice.models.layers re-exports a function `moe` that an attribute import would give
    experts = importlib.import_module("sluice.models.layers.experts")
    moe = importlib.import_module("sluice.models.layers.moe")
    if _GEMM_BLOCKS is None:  # sluice.quant.matmul's own values, read before any with_kernels changed them
        _GEMM_BLOCKS = (matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK)

    def attr(module, field):
        return (lambda: getattr(module, field)), (lambda v: setattr(module, field, v))

    def gemm_blocks(on: bool | tuple[int, int]) -> None:  # a tuple: the values a with block puts back
        blocks_ = on if isinstance(on, tuple) else _GEMM_BLOCKS if on else (1 << 40, 1 << 40)
        matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK = blocks_

    def gemm_row_step(step: int) -> None:  # moe.py imports experts.py's constant: its own name to set too
        experts.GEMM_ROW_STEP = moe.GEMM_ROW_STEP = step

    table = {
        "threads": (pool.threads, pool.set_threads),
        # no getter in the extension: the documented defaults (q8.set_super_blocks, q8.set_prefetch)
        "super_blocks": (lambda: True, q8.set_super_blocks),
        "prefetch": (lambda: 2048, q8.set_prefetch),
        "read_group": attr(streaming, "PROMPT_READ_GROUP"),
        "gemm_blocks": (lambda: (matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK), gemm_blocks),
        "gemm_row_step": (lambda: experts.GEMM_ROW_STEP, gemm_row_step),
    }
    if name not in table:
        raise ValueError(f"with_kernels: unknown choice {name!r}; known: {', '.join([*MODEL_SWITCHES, *table])}")
    return table[name]


def _with_switches(model, switches: dict[str, bool]):
    """model's transformer built with `switches` changed in its Kernels (the same transformer when none changes)."""
    from dataclasses import replace

    tm = model.model
    kernels = replace(tm.kernels, **switches)
    if kernels == tm.kernels:
        return tm
    built = _REBUILT.setdefault(tm, {})
    if kernels not in built:
        built[kernels] = tm.rebuilt(kernels)
    return built[kernels]


@contextmanager
def with_kernels(model=None, **choices: Any) -> Iterator[None]:
    """Set `choices` (see MODEL_SWITCHES and _process_choice) for the block, then put back what was there.
    `model`: a loaded sluice Model, for the model switches (its transformer is swapped for one built with them, and
    the old one put back after the block).

        with with_kernels(m, native_decode=False):
            m.replay(prompt, tokens)
        with with_kernels(threads=1, super_blocks=False):
            call.many(...)
    """
    switches = {k: v for k, v in choices.items() if k in MODEL_SWITCHES}
    if switches and model is None:
        raise ValueError(f"with_kernels: {', '.join(switches)} switch(es) of a loaded model: pass the model")
    undo: list[Any] = []
    try:
        for name, value in choices.items():
            if name not in MODEL_SWITCHES:
                get, put = _process_choice(name)
                old = get()
                put(value)
                undo.append(lambda o=old, p=put: p(o))
        if switches:
            old_tm = model.model
            model.model = _with_switches(model, switches)
            undo.append(lambda: setattr(model, "model", old_tm))
        yield
    finally:
        for u in reversed(undo):
            u()


def commit() -> str:
    """The repository's HEAD, short, with "+dirty" when source files differ from it (sluice bench's rule: results
    folders do not count): what a committed result names."""
    from sluice.commands.bench import source_commit

    return source_commit() or "unknown"


def processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process (/proc; one that exits meanwhile is left out)."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        out[int(d)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
    return out


def descendants(root: int) -> dict[int, bytes]:
    """pid -> command line of every process below `root`."""
    procs, found, todo = processes(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, cmd) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = cmd
                todo.append(pid)
    return found
