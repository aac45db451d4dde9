"""benchmarks/common.py's timing protocol (the benchmark scripts' alternate / median_ms / medians): the rotated order,
warm-up calls and the ms arithmetic, on a fake clock (no real timing)."""

from __future__ import annotations

import pytest

from benchmarks.common import alternate, median_ms, medians


def test_alternate_rotates_the_order_and_keeps_results_per_arm():
    calls: list[str] = []

    def arm(name):
        def run():
            calls.append(name)
            return f"{name}{sum(c == name for c in calls)}"
        return run

    reported = []
    out = alternate({"a": arm("a"), "b": arm("b"), "c": arm("c")}, rounds=3,
                    report=lambda r, k, res: reported.append((r, k, res)))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each arm once in each position
    assert out == {"a": ["a1", "a2", "a3"], "b": ["b1", "b2", "b3"], "c": ["c1", "c2", "c3"]}
    assert reported[:4] == [(0, "a", "a1"), (0, "b", "b1"), (0, "c", "c1"), (1, "b", "b2")]


def test_alternate_takes_any_hashable_arm_names():
    out = alternate({("resident", 1): lambda: 1.0, ("streamed", 2): lambda: 2.0}, rounds=2)
    assert out == {("resident", 1): [1.0, 1.0], ("streamed", 2): [2.0, 2.0]}


class FakeClock:
    """Seconds that advance only when an arm runs: arm costs are known, so the medians are exact."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_median_ms_warms_up_then_times_reps_per_round():
    clock = FakeClock()
    counts = {"fast": 0, "slow": 0}
    slow_costs = iter([0.0, 0.010, 0.050, 0.010, 0.012, 0.011, 0.011] + [0.011] * 20)

    def fast():
        counts["fast"] += 1
        clock.t += 0.002

    def slow():
        counts["slow"] += 1
        clock.t += next(slow_costs)

    ms = median_ms({"fast": fast, "slow": slow}, rounds=3, reps=2, warmup=1, clock=clock)
    assert counts == {"fast": 1 + 3 * 2, "slow": 1 + 3 * 2}  # one warm-up call each, then 3 rounds x 2 reps
    assert ms["fast"] == pytest.approx(2.0)
    # slow's rounds after the warm-up (cost 0): (10 + 50) / 2 = 30, (10 + 12) / 2 = 11, (11 + 11) / 2 = 11 ms
    assert ms["slow"] == pytest.approx(11.0)


def test_medians_and_bad_counts():
    assert medians({"a": [3.0, 1.0, 2.0], "b": [4.0, 6.0]}) == {"a": 2.0, "b": 5.0}
    with pytest.raises(ValueError, match="rounds"):
        alternate({"a": lambda: 0}, rounds=0)
    with pytest.raises(ValueError, match="reps"):
        median_ms({"a": lambda: 0}, rounds=1, reps=0)
