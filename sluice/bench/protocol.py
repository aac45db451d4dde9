"""The A/B protocol: arm order rotated per round, per-arm summaries over rounds, ratios paired per round against the
reference arm (its first arm), and the identity gate over every replayed step's argmax.

Pure functions over `Run` records, so the arithmetic is tested on synthetic numbers without a model.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """Arm order in round `round_index`: the list rotated left by the round number, so over len(names) rounds each
    arm runs once in each position (first after the reference's generation child, last, ...)."""
    k = round_index % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


@dataclass
class Run:
    """One child's run of one arm in one round. `record` is the child's JSON (None when it failed)."""

    arm: str
    round: int
    position: int  # place in this round's order, 0 = first
    record: dict[str, Any] | None = None
    error: str | None = None
    oom: bool = False
    residency: dict[str, Any] | None = None
    cgroup_peak_bytes: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.record is not None and self.error is None and not self.oom

    def step_ms(self) -> list[float]:
        """Timed decode steps in ms (empty for a failed run)."""
        return [1000 * s for s in self.record["step_s"]] if self.ok else []

    def to_json(self) -> dict[str, Any]:
        """A plain dict; Run(**d) rebuilds it."""
        return asdict(self)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    at = (len(s) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _first(*xs):
    """The first of xs that is not None (None when all are)."""
    return next((x for x in xs if x is not None), None)


def floor_fields(step_ms: float | None, prefill_ms: float | None, floor: dict[str, Any] | None) -> dict[str, Any]:
    """The summary's floor fields from an arm's floor measurements (floor.measure records under "before" and
    "after"; either may be missing): each one's decode and prompt floors, the faster of the two, and step time
    against each and against the faster. A floor of 0 (nothing read) gives no ratio."""
    out: dict[str, Any] = {}
    for when in ("before", "after"):
        m = (floor or {}).get(when) or {}
        out[f"floor_ms_{when}"] = m.get("floor_ms")
        out[f"prefill_floor_ms_{when}"] = m.get("prefill_floor_ms")
    for key in ("floor_ms", "prefill_floor_ms"):
        vals = [out[f"{key}_{w}"] for w in ("before", "after") if out[f"{key}_{w}"] is not None]
        out[key] = min(vals) if vals else None

    def ratio(t: float | None, f: float | None) -> float | None:
        return t / f if t is not None and f else None

    out["step_floor_before"] = ratio(step_ms, out["floor_ms_before"])
    out["step_floor_after"] = ratio(step_ms, out["floor_ms_after"])
    out["step_floor_ratio"] = ratio(step_ms, out["floor_ms"])  # against the faster floor: the stricter bar
    out["prefill_floor_ratio"] = ratio(prefill_ms, out["prefill_floor_ms"])
    return out


def paired_floor(runs: Sequence[Run], floor: dict[str, Any] | None) -> dict[str, Any]:
    """Each run's median step against the floor replayed right after it in the same round (bench
    --floor-each-round: the disk at the same moment): the ratios in round order, their median, and the floors; {}
    without per-round floors."""
    rounds = (floor or {}).get("rounds") or {}
    pairs = [(r.round, statistics.median(r.step_ms()), rounds[str(r.round)]["floor_ms"]) for r in runs
             if r.step_ms() and rounds.get(str(r.round), {}).get("floor_ms")]
    if not pairs:
        return {}
    pairs.sort()
    ratios = [step / f for _, step, f in pairs]
    return {"floor_ms_rounds": [f for _, _, f in pairs], "step_floor_rounds": ratios,
            "step_floor_paired": statistics.median(ratios)}


def summarize(runs: Sequence[Run], floor: dict[str, Any] | None = None) -> dict[str, Any]:
    """Metrics of one arm over its rounds. Step latency median/p90 pool every timed step of every round; the
    per-run rates (tok/s, CPU, faults, bytes per step) are medians over rounds; peak RSS is the maximum. `floor`:
    the arm's floor measurements, {"before": ..., "after": ...} (see floor_fields)."""
    ok = [r for r in runs if r.ok]
    out: dict[str, Any] = {
        "runs": len(runs),
        "ok_runs": len(ok),
        "oom_runs": sum(r.oom for r in runs),
        "errors": sorted({r.error for r in runs if r.error and not r.oom}),
    }
    if not ok:
        return out
    steps = [ms for r in ok for ms in r.step_ms()]

    def per_step(r: Run, key: str, scale: float = 1.0) -> float | None:
        w = r.record["window"]
        return scale * w[key] / w["steps"] if w.get("steps") and key in w else None

    def hit_rate(r: Run) -> float | None:
        w = r.record["window"]
        n = w["hits"] + w["misses"]
        return w["hits"] / n if n else None

    out.update(
        step_ms_median=statistics.median(steps),
        step_ms_p90=percentile(steps, 90),
        tok_s=_median([len(r.record["step_s"]) / sum(r.record["step_s"]) for r in ok if sum(r.record["step_s"])]),
        prefill_ms=_median([1000 * r.record["prefill_s"] for r in ok]),
        prefill_tok_s=_median([r.record["prefill_tokens"] / r.record["prefill_s"] for r in ok
                               if r.record.get("prefill_tokens") and r.record["prefill_s"]]),
        # the disk's count (/proc/self/io) is comparable across tools; sluice's own count when the kernel has none
        prefill_read_bytes=_median([_first(r.record.get("prefill_disk_read_bytes"), r.record.get("prefill_bytes_read"))
                                    for r in ok]),
        cpu_ms_per_step=_median([per_step(r, "cpu_s", 1000) for r in ok]),
        peak_rss_bytes=max(r.record["peak_rss_bytes"] for r in ok),
        cgroup_peak_bytes=max(r.cgroup_peak_bytes for r in runs) or None,
        major_faults_per_step=_median([per_step(r, "major_faults") for r in ok]),
        minor_faults_per_step=_median([per_step(r, "minor_faults") for r in ok]),
        reader_major_faults_per_step=_median([per_step(r, "reader_major_faults") for r in ok]),
        reader_minor_faults_per_step=_median([per_step(r, "reader_minor_faults") for r in ok]),
        bytes_read_per_step=_median([per_step(r, "bytes_read") for r in ok]),
        disk_read_bytes_per_step=_median([per_step(r, "disk_read_bytes") for r in ok]),
        hit_rate=_median([hit_rate(r) for r in ok]),
        io_wait_ms_per_step=_median([per_step(r, "io_wait_s", 1000) for r in ok]),
    )
    out.update(floor_fields(out["step_ms_median"], out["prefill_ms"], floor))
    out.update(paired_floor(ok, floor))
    # counters a later feature adds to Model.stats() (prefetch recall, waste, ...): carried as medians over rounds
    for key in sorted({k for r in ok for k in r.record.get("stats", {}) if k.startswith("prefetch")}):
        vals = [r.record["stats"].get(key) for r in ok]
        out[key] = _median([v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)])
    return out


def best_of_peers(arms: Sequence[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """For each peer kind with a successful arm (e.g. llama.cpp run three ways: defaults, repacking off,
    MADV_RANDOM): its fastest arm at decode (lowest median step) and at the prompt (highest prefill tok/s), and
    sluice's best arm at each against it as a ratio of tokens/s (> 1: sluice is faster). `arms`: Arm.to_json()s."""
    def ok(a: dict[str, Any]) -> bool:
        return bool(summary[a["name"]]["ok_runs"])

    def fastest(names: list[str]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        decode = min(names, key=lambda n: summary[n]["step_ms_median"], default=None)
        with_prompt = [n for n in names if summary[n].get("prefill_tok_s")]
        prompt = max(with_prompt, key=lambda n: summary[n]["prefill_tok_s"], default=None)
        return (None if decode is None else {"arm": decode, "step_ms": summary[decode]["step_ms_median"]},
                None if prompt is None else {"arm": prompt, "prefill_tok_s": summary[prompt]["prefill_tok_s"]})

    own_decode, own_prompt = fastest([a["name"] for a in arms if a.get("peer") is None and ok(a)])
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(a["peer"] for a in arms if a.get("peer")):
        names = [a["name"] for a in arms if a.get("peer") == kind and ok(a)]
        if not names:
            continue
        decode, prompt = fastest(names)
        if decode is not None and own_decode is not None:
            decode.update(sluice_arm=own_decode["arm"], sluice_step_ms=own_decode["step_ms"],
                          sluice_vs_best=decode["step_ms"] / own_decode["step_ms"])
        if prompt is not None and own_prompt is not None:
            prompt.update(sluice_arm=own_prompt["arm"], sluice_prefill_tok_s=own_prompt["prefill_tok_s"],
                          sluice_vs_best=own_prompt["prefill_tok_s"] / prompt["prefill_tok_s"])
        out[kind] = {"arms": names, "decode": decode, "prefill": prompt}
    return out


def pair(runs: Sequence[Run], reference: str, arm: str) -> dict[str, Any]:
    """Per round where both ran: ratio = arm's median step / reference's median step (< 1 is faster); a round is a
    paired win when the ratio is below 1. Returns ratios by round, their median and p90, wins and pairs."""
    by_round: dict[int, dict[str, Run]] = {}
    for r in runs:
        if r.ok:
            by_round.setdefault(r.round, {})[r.arm] = r
    ratios: dict[int, float] = {}
    for rnd, got in sorted(by_round.items()):
        if reference in got and arm in got:
            ref = statistics.median(got[reference].step_ms())
            ratios[rnd] = statistics.median(got[arm].step_ms()) / ref if ref else math.nan
    vals = list(ratios.values())
    return {
        "ratios": ratios,
        "ratio_median": statistics.median(vals) if vals else None,
        "ratio_p90": percentile(vals, 90) if vals else None,
        "wins": sum(v < 1 for v in vals),
        "pairs": len(vals),
    }


def wins_text(p: dict[str, Any]) -> str:
    """'4/5 paired': rounds the arm beat the reference, over rounds where both ran."""
    return f"{p['wins']}/{p['pairs']} paired"


def mismatches(expected: Sequence[int], got: Sequence[int]) -> list[int]:
    """Step indices where `got` differs from `expected`; steps missing from the shorter one count as different."""
    diff = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    return diff + list(range(min(len(expected), len(got)), max(len(expected), len(got))))


def identity(runs: Sequence[Run], reference: str) -> dict[str, Any]:
    """The identity gate: every ok run's argmax at every replayed step against the reference arm's first ok run
    (in round order). The reference's own later rounds are compared too, which catches non-determinism."""
    ordered = sorted((r for r in runs if r.ok), key=lambda r: (r.round, r.position))
    base = next((r for r in ordered if r.arm == reference), None)
    out: dict[str, Any] = {"reference": None, "arms": {}, "identical": False}
    if base is None:
        return out
    expected = base.record["argmax"]
    out["reference"] = {"arm": base.arm, "round": base.round, "steps": len(expected)}
    for r in ordered:
        a = out["arms"].setdefault(r.arm, {"runs_compared": 0, "steps_compared": 0, "mismatched_steps": 0,
                                           "runs_with_mismatch": 0, "first_mismatch": None})
        diff = mismatches(expected, r.record["argmax"])
        a["runs_compared"] += 1
        a["steps_compared"] += max(len(expected), len(r.record["argmax"]))
        a["mismatched_steps"] += len(diff)
        if diff:
            a["runs_with_mismatch"] += 1
            if a["first_mismatch"] is None:
                i = diff[0]
                got = r.record["argmax"]
                a["first_mismatch"] = {"round": r.round, "step": i, "expected": expected[i] if i < len(expected)
                                       else None, "got": got[i] if i < len(got) else None}
    out["identical"] = all(a["mismatched_steps"] == 0 for a in out["arms"].values())
    return out


def identity_text(arm_identity: dict[str, Any] | None) -> str:
    """'identical (122/122)' or '3/122 differ (first: round 1 step 7)' or 'n/a'."""
    if not arm_identity or not arm_identity["runs_compared"]:
        return "n/a"
    a = arm_identity
    if not a["mismatched_steps"]:
        return f"identical ({a['steps_compared']}/{a['steps_compared']})"
    f = a["first_mismatch"]
    return f"{a['mismatched_steps']}/{a['steps_compared']} differ (first: round {f['round']} step {f['step']})"
