"""The bench's I/O floor (sluice/bench/floor.py): the arm's read plan is what its readers read, step by step; the
floor replays exactly those ranges, cold, with readers made like the arm's; the arithmetic of before / after."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import sluice
from sluice.bench import floor as floormod
from sluice.bench.launch import model_files, prepare
from sluice.bench.protocol import floor_fields
from sluice.host.procstat import disk_read_bytes
from sluice.io.engines import resolve_engine

from .test_bench import budgets, disk_dir, model_dir  # noqa: F401 (fixtures)


def record(model: Path, memory: str, prompt: list[int], tokens: list[int], warmup: int, **options):
    """Replay with a Recorder, as child.py `replay --journal` does, and capture independently what the store asked
    the reader for (the requested ranges of each submit, before the reader plans them), cut at the same steps."""
    with sluice.load(model, memory=memory, **options) as m:
        rec = floormod.Recorder(m)
        asked: list[list[tuple[str, int, int]]] = [[]]
        submit, submit_each = m.reader.submit, m.reader.submit_each

        def spy(requests):
            asked[-1].extend((r.path, r.offset, r.nbytes) for r, _ in requests)
            return submit(requests)

        def spy_each(batches):
            for requests in batches:
                asked[-1].extend((r.path, r.offset, r.nbytes) for r, _ in requests)
            return submit_each(batches)

        # the store calls reader.submit (read() goes through it too), and submit_each for a decode step's misses, or
        # submit_templates with each expert's ranges planned once (templates_at, a layer at a time): its ranges, each
        # time it is submitted
        m.reader.submit, m.reader.submit_each = spy, spy_each
        if hasattr(m.reader, "templates_at"):  # the direct reader
            templates_at, submit_templates, planned = m.reader.templates_at, m.reader.submit_templates, {}

            def spy_template(batches):
                ts = templates_at(batches)
                for t, ranges in zip(ts, batches):
                    planned[id(t)] = (t, [(r.path, r.offset, r.nbytes) for r, _ in ranges])
                return ts

            def spy_templates(items):
                for t, _ in items:
                    asked[-1].extend(planned[id(t)][1])
                return submit_templates(items)

            m.reader.templates_at, m.reader.submit_templates = spy_template, spy_templates

        def on_step(end):
            rec.mark()
            asked.append([])

        m.replay(prompt, tokens, on_step=on_step)
        return rec.plan(warmup), asked[:-1], m.reader.stats()


def windows(part) -> list[tuple[int, int, int]]:
    return sorted((f, off, n) for _, ranges in part for f, off, n in ranges)


def test_the_plan_is_what_the_readers_read_step_by_step(model_dir, capsys):
    bf16, _ = budgets(model_dir, capsys)
    prompt, tokens = [5, 17, 42, 7, 99, 3], [11, 12, 13, 14, 15, 16]
    # no decode read-ahead (--prefetch router: a guess evicted before its step may be read again in it, so "exactly
    # one read" is the plain store's property)
    plan, asked, stats = record(model_dir, bf16, prompt, tokens, warmup=2, io="direct", io_workers=3, odirect=True,
                                prefetch="none")
    assert plan["readers"] == [{"mode": "direct", "workers": 3, "odirect": True, "engine": resolve_engine("auto")}]
    assert plan["warmup"] == 2 and len(plan["steps"]) == len(tokens)
    files = plan["files"]
    assert files and all(Path(f).parent == model_dir for f in files)
    parts = [plan["prefill"], *plan["steps"]]
    assert len(parts) == len(asked)
    # each step's file reads cover exactly the ranges the store asked for in that step: every asked range lies in
    # one read of the same step, and every read holds an asked range (gaps between ranges may be read through)
    for part, want in zip(parts, asked):
        got = windows(part)
        for path, off, n in set(want):
            inside = [w for w in got if files[w[0]] == path and w[1] <= off and off + n <= w[1] + w[2]]
            assert len(inside) == 1, (path, off, n)
        for f, off, n in got:
            assert any(files[f] == p and off <= o and o + m <= off + n for p, o, m in want)
    # the plan holds every byte the reader read after load (the steps that missed, and the prompt)
    assert floormod.batch_bytes([b for part in parts for b in part]) <= stats["bytes_read"]
    assert sum(map(floormod.batch_bytes, plan["steps"])) > 0  # 6 of 16 experts held: decode steps miss


def test_the_floor_replays_exactly_the_plan_cold(model_dir, capsys):
    bf16, _ = budgets(model_dir, capsys)
    plan, _, _ = record(model_dir, bf16, [5, 17, 42, 7, 99, 3], [11, 12, 13, 14, 15], warmup=1, io="direct",
                        io_workers=2, odirect=False)
    prepare(model_files(model_dir), "cold", "the test's floor")  # what the bench does before the floor child
    io0 = disk_read_bytes()
    journal: list = []
    got = floormod.measure(json.loads(json.dumps(plan)), journal=journal)  # the plan as the child reads it
    assert got["ok"] and got["resident_before"] <= 0.01  # cold when the replay started
    # the replay's reader read exactly the plan's ranges: the same windows, batch for batch
    replayed = Counter(tuple(sorted((off, n) for _, off, n in batch)) for batch in journal)
    planned = Counter(tuple(sorted((off, n) for _, off, n in ranges))
                      for part in [plan["prefill"], *plan["steps"]] for _, ranges in part)
    assert replayed == planned
    assert {p for batch in journal for p, _, _ in batch} == set(plan["files"])
    assert got["readers"] == [{"mode": "direct", "workers": 2, "odirect": False, "engine": resolve_engine("auto"),
                               "odirect_fallback": False}]
    timed = plan["steps"][1:]
    assert len(got["step_s"]) == 5 and got["warmup"] == 1
    assert got["window_bytes"] == sum(map(floormod.batch_bytes, timed)) > 0
    assert got["floor_ms"] == pytest.approx(1000 * sum(got["step_s"][1:]) / 4)
    assert got["prefill_bytes"] == floormod.batch_bytes(plan["prefill"])
    if disk_read_bytes() > io0:  # the kernel counts this process's disk reads: cold reads reached the disk
        assert got["window_disk_read_bytes"] + got["prefill_disk_read_bytes"] > 0


def test_the_floor_reads_o_direct_zero_copy_as_the_arm_does(model_dir, capsys):
    """The streaming store places each slot at its file offset modulo the O_DIRECT block, so O_DIRECT reads its whole
    pages into it with no copy; the replay's destinations sit the same way, so it copies only the partial pages at
    the ends of a range (it copied every byte out of staging before: a slower floor than the arm's own reads)."""
    bf16, _ = budgets(model_dir, capsys)
    plan, _, arm = record(model_dir, bf16, [5, 17, 42, 7, 99, 3], [11, 12, 13, 14, 15], warmup=1, io="direct",
                          io_workers=2, odirect=True)
    prepare(model_files(model_dir), "cold", "the test's floor")
    got = floormod.measure(json.loads(json.dumps(plan)))
    read = got["prefill_bytes"] + sum(map(floormod.batch_bytes, plan["steps"]))
    if got["readers"][0]["odirect_fallback"]:
        pytest.skip("this filesystem refuses O_DIRECT reads: the replay reads buffered, nothing to compare")
    ranges = sum(len(r) for part in [plan["prefill"], *plan["steps"]] for _, r in part)
    assert read > 0 and got["copied_bytes"] <= 2 * 4096 * ranges  # at most a partial page at each end of a range
    assert got["copied_bytes"] <= max(arm["copied_bytes"], 2 * 4096 * ranges)


def test_the_floor_reader_is_the_arms_kind(model_dir, capsys):
    """An mmap arm's floor faults its ranges in through a mapping, as the arm does; nothing read, no floor."""
    bf16, _ = budgets(model_dir, capsys)
    plan, _, _ = record(model_dir, bf16, [5, 17, 42], [11, 12, 13], warmup=0, io="mmap")
    assert plan["readers"][0]["mode"] == "mmap"
    prepare(model_files(model_dir), "cold", "the test's floor")
    got = floormod.measure(plan)
    assert got["readers"][0]["mode"] == "mmap" and got["window_bytes"] == sum(map(floormod.batch_bytes,
                                                                                    plan["steps"]))
    empty = {**plan, "prefill": [], "steps": [[], []]}
    nothing = floormod.measure(empty)
    assert nothing["floor_ms"] == 0.0 and nothing["bytes_per_s"] is None


def test_floor_fields_before_after_and_the_faster():
    f = floor_fields(30.0, 500.0, {"before": {"floor_ms": 10.0, "prefill_floor_ms": 200.0},
                                   "after": {"floor_ms": 12.0, "prefill_floor_ms": 100.0}})
    assert (f["floor_ms_before"], f["floor_ms_after"], f["floor_ms"]) == (10.0, 12.0, 10.0)
    assert f["step_floor_before"] == pytest.approx(3.0) and f["step_floor_after"] == pytest.approx(2.5)
    assert f["step_floor_ratio"] == pytest.approx(3.0)  # against the faster floor
    assert f["prefill_floor_ms"] == 100.0 and f["prefill_floor_ratio"] == pytest.approx(5.0)
    only = floor_fields(30.0, None, {"after": {"floor_ms": 15.0, "prefill_floor_ms": 1.0}})
    assert only["floor_ms_before"] is None and only["floor_ms"] == 15.0 and only["step_floor_ratio"] == 2.0
    assert only["prefill_floor_ratio"] is None
    zero = floor_fields(30.0, 10.0, {"before": {"floor_ms": 0.0}, "after": {"floor_ms": 0.0}})
    assert zero["floor_ms"] == 0.0 and zero["step_floor_ratio"] is None  # nothing read: no ratio
    assert floor_fields(30.0, 10.0, None)["floor_ms"] is None
