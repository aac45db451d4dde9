"""One bench run in a fresh process: `python -m sluice.bench.child generate|replay|floor ...` prints one JSON line.

    generate  load the reference arm, generate the sequence every arm will replay (greedy, or sampled with a seed)
    replay    load an arm, feed the recorded sequence step by step (teacher forcing, Model.replay), and measure;
              with --journal, also return the arm's read plan (floor.Recorder: every batch its readers planned)
    floor     replay a read plan (--plan FILE) through readers made like the arm's, and time it (floor.measure)

A fresh process per run is the isolation the protocol needs: no expert cache, page-cache mapping, allocator state
or thread pool carries over from one arm to the next. Errors a user can fix (SluiceError) come back as
{"ok": false, "error": ...} with exit status 2; anything else is a traceback on stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from .. import load
from ..errors import SluiceError
from ..host.procstat import disk_read_bytes
from . import BenchError
from .floor import Recorder, measure


def process_counters(m) -> dict[str, float]:
    """Counters the timed window is a delta of: process-wide ones (every thread, the I/O workers included), and
    the faults taken inside reads, which the reader charges per thread (getrusage RUSAGE_THREAD)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rd = m.reader.stats()
    return {
        "disk_read_bytes": disk_read_bytes(),
        "major_faults": ru.ru_majflt,
        "minor_faults": ru.ru_minflt,
        "reader_major_faults": rd.get("major_faults", 0),
        "reader_minor_faults": rd.get("minor_faults", 0),
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "wall_s": time.perf_counter(),
    }


IO_FIELDS = ("hits", "misses", "bytes_read", "io_wait_s")


def io_counters(m) -> tuple[float, ...]:
    """(hits, misses, bytes read, critical-path wait) of the expert store, plus bytes of lazily read embedding rows.

    Cheap (a few counters), because it is taken inside every timed step."""
    st = m.store.stats()
    return st.get("hits", 0), st.get("misses", 0), m.bytes_read(st), st.get("io_wait_s", 0.0)


class StepProbe:
    """`Model.replay`'s per-step callback: records the store counters after each step that ends at or past the start
    of the timed window (prompt + warmup tokens), and the process counters once, when the window opens. The window
    therefore opens after the last untimed step (the prefill when warmup is 0) and all timed I/O lands inside it.
    """

    def __init__(self, m, n_prompt: int, warmup: int, recorder: Recorder | None = None):
        self._m = m
        self.window_end_pos = n_prompt + warmup
        self.start: dict[str, float] | None = None
        self.marks: list[tuple[float, ...]] = []  # marks[0]: window opens; marks[i + 1]: after timed step i
        self.recorder = recorder  # cut at the prefill's end and at each step's
        self.n_prompt = n_prompt
        self.prefill_end: dict[str, float] | None = None  # process counters when the prefill ends

    def __call__(self, end: int) -> None:
        """`end`: tokens in the cache after the step."""
        if self.recorder is not None:
            self.recorder.mark()
        if end == self.n_prompt:
            self.prefill_end = process_counters(self._m)
        if end == self.window_end_pos:
            self.start = process_counters(self._m)
        if end >= self.window_end_pos:
            self.marks.append(io_counters(self._m))


def _deltas(marks: list[tuple[float, ...]], i: int) -> list[float]:
    return [round(b[i] - a[i], 6) for a, b in zip(marks, marks[1:])]


def _prefill_counters(before: dict[str, float], after: dict[str, float] | None) -> dict[str, float | None]:
    """The prefill's major page faults (every thread: a mapped table's or expert's cold pages) and CPU seconds."""
    if after is None:
        return {"prefill_major_faults": None, "prefill_cpu_s": None}
    return {"prefill_major_faults": after["major_faults"] - before["major_faults"],
            "prefill_cpu_s": round(after["cpu_s"] - before["cpu_s"], 4)}


def replay(model: str, options: dict[str, Any], prompt: list[int], tokens: list[int], warmup: int,
           journal: bool = False) -> dict:
    """Replay `tokens` after `prompt` in arm `options`; decode steps before `warmup` are untimed. `journal`: also
    record the arm's read plan (the bench's floor replays it)."""
    t0 = time.perf_counter()
    m = load(model, **options)
    load_s = time.perf_counter() - t0
    try:
        recorder = Recorder(m) if journal else None  # after load: the plan holds the prompt's and steps' reads
        probe = StepProbe(m, len(prompt), warmup, recorder)
        before = process_counters(m)
        argmax = m.replay(prompt, tokens, on_step=probe)
        end = process_counters(m)
        if probe.start is None:
            raise BenchError(f"the timed window never opened: {len(tokens)} tokens for {warmup} warm-up steps")
        times = m.step_times.decode_s
        window = {k: end[k] - probe.start[k] for k in end}
        window["steps"] = len(times) - warmup
        for i, k in enumerate(IO_FIELDS):
            window[k] = probe.marks[-1][i] - probe.marks[0][i]
        stats = m.stats()
        extra = {"plan": recorder.plan(warmup)} if recorder is not None else {}
        return {
            **extra,
            "ok": True,
            "argmax": argmax,
            "load_s": round(load_s, 4),
            "prefill_s": m.step_times.prefill_s,
            "prefill_tokens": m.step_times.prefill_tokens,
            # what the prefill read: the store's expert bytes + embedding rows, and what the disk delivered
            "prefill_bytes_read": stats.get("prefill_bytes_read"),
            "prefill_disk_read_bytes": stats.get("prefill_disk_read_bytes"),
            # the prefill's page faults (every thread: a mapped table's or expert's cold pages) and CPU time
            **_prefill_counters(before, probe.prefill_end),
            "warmup_step_s": times[:warmup],
            "step_s": times[warmup:],
            "step_bytes_read": _deltas(probe.marks, 2),
            "step_misses": _deltas(probe.marks, 1),
            "step_io_wait_s": _deltas(probe.marks, 3),
            "window": window,
            # VmHWM, from Model.stats(): getrusage's ru_maxrss would carry the harness's peak across fork+exec
            "peak_rss_bytes": stats["peak_rss_bytes"],
            "stats": stats,
            "reader": m.reader.stats(),  # whole run, load included; faults per I/O thread
        }
    finally:
        m.close()


def generate(model: str, options: dict[str, Any], n_tokens: int, prompt: str | None, prompt_tokens: int,
             temperature: float, seed: int) -> dict:
    """The reference sequence: prompt ids (encoded text, or `prompt_tokens` seeded random ids) and `n_tokens`
    generated ids. EOS does not stop it: every arm must replay exactly `n_tokens` steps."""
    import torch

    with load(model, **options) as m:
        if prompt is not None:
            ids = m.encode_prompt(prompt)
        else:
            if prompt_tokens >= m.cache.max_context:  # checked before a list of that many ids is made
                raise BenchError(f"--prompt-tokens {prompt_tokens} leaves no room to generate in the context of "
                                 f"{m.cache.max_context} tokens: use fewer, or raise --max-context")
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, m.spec.vocab_size, (prompt_tokens,), generator=g).tolist()
        tokens = list(m.generate_tokens(ids, max_tokens=n_tokens, temperature=temperature, seed=seed,
                                        stop_at_eos=False))
        if len(tokens) < n_tokens:
            raise BenchError(
                f"the context holds only {len(tokens)} of the {n_tokens} warm-up + timed steps after a "
                f"{len(ids)}-token prompt: shorten the prompt or the steps, or raise --max-context"
            )
        return {"ok": True, "prompt_ids": ids, "tokens": tokens, "stats": m.stats()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.child", description=__doc__)
    p.add_argument("mode", choices=["generate", "replay", "floor"])
    p.add_argument("--model", required=True)
    p.add_argument("--options", default="{}", help="LoadOptions keyword arguments as JSON")
    p.add_argument("--work", help="replay: JSON file holding prompt_ids and tokens")
    p.add_argument("--warmup", type=int, default=0, help="replay: untimed decode steps first")
    p.add_argument("--journal", action="store_true", help="replay: also return the arm's read plan")
    p.add_argument("--plan", help="floor: JSON file holding a read plan (a replay --journal record's `plan`)")
    p.add_argument("--tokens", type=int, default=0, help="generate: tokens to generate")
    p.add_argument("--prompt", default=None, help="generate: prompt text (needs the model's tokenizer)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="generate: random prompt ids when no text")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    options = json.loads(a.options)
    try:
        if a.mode == "generate":
            out = generate(a.model, options, a.tokens, a.prompt, a.prompt_tokens, a.temperature, a.seed)
        elif a.mode == "floor":
            with open(a.plan) as f:
                out = measure(json.load(f))
        else:
            with open(a.work) as f:
                work = json.load(f)
            out = replay(a.model, options, work["prompt_ids"], work["tokens"], a.warmup, a.journal)
    except SluiceError as e:
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
