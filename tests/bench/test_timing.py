"""benchmarks/common.py's timing protocol (the benchmark scripts' alternate / median_ms / medians): the rotated order,
warm-up calls and the ms arithmetic, on a fake clock (no real timing)."""

from __future__ import annotations

import pytest

from benchmarks.common import alternate, alternate_tokens, median_ms, medians


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


def test_alternate_tokens_switches_each_arm_before_its_tokens():
    """alternate_tokens: per round each arm's switch, in alternate's order, then one untimed token and per_arm timed
    ones from the same stream; one ms-a-token figure per arm and round."""
    events: list = []

    def tokens():
        n = 0
        while True:
            n += 1
            events.append(n)
            yield n

    out = alternate_tokens(tokens(), {"off": lambda: events.append("off"), "on": lambda: events.append("on")},
                           rounds=2, per_arm=3)
    assert events == ["off", 1, 2, 3, 4, "on", 5, 6, 7, 8, "on", 9, 10, 11, 12, "off", 13, 14, 15, 16]
    assert list(out) == ["off", "on"] and all(len(v) == 2 and all(t >= 0 for t in v) for v in out.values())


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
