"""Prefetch bookkeeping of the streaming store: deferred predictions, the throttle, and its counters.

The prerouter predicts layer L+1's experts from the hidden state after layer L's attention. The reads are issued
right after layer L's own experts are pinned (so a prefetch can never evict what the current layer is about to
use, and the reads overlap layer L's expert math): `defer` keeps the prediction until the store's next acquire.

Throttle (`Throttle`): whether each guessed read was routed to by the layer's very next acquire (1) or not (0), over
a window of the last guessed reads; when their share falls below the throttle's precision, guessing pauses for a
cooldown (wasted reads compete with demand reads for the same disk), then tries again. `--prefetch router` pauses
below 20% for 64 guesses; `--prefetch auto` (the default) pauses below 80%, its cooldown growing 4x with each window
that fails again (up to 4,096 guesses), and while paused the guess is not even computed (StreamingExpertStore.guessing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Throttle:
    """When a decode's guesses pause: below `precision` (the share of a full `window` of guessed reads that the layer's
    next acquire used), for `cooldown` guesses, times `growth` after each window that fails again, up to
    `max_cooldown`; a window that passes resets the cooldown."""

    precision: float
    window: int
    cooldown: int
    growth: int = 1
    max_cooldown: int = 64


#: `--prefetch router`: a safety net only (guessing as asked, paused when nearly every guess is wasted)
ROUTER_THROTTLE = Throttle(precision=0.2, window=128, cooldown=64)
#: `--prefetch auto`: guess where the guesses are good. Measured (benchmarks/results/prefetch-router, Intel Xeon, cold,
#: a cgroup ceiling): guesses 92-99% right won (the issue-30 hybrid Q4_K_M 128.6 -> 103.2 ms a token, the peers
#: Q4_K_M 62.2 -> 57.5), 68% right lost (the trained demo, +55% bytes read, 48.3 -> 58.3 ms); 0.8 lies between. A
#: window of 64 reads tells 68% from 80% by two standard deviations (sqrt(0.68 * 0.32 / 64) = 0.058). With it
#: (benchmarks/results/prefetch-router/amd-avx2, AMD EPYC AVX2, `bash benchmarks/prefetch_router.sh`): the hybrid
#: 89.62 -> 71.78 ms (never paused), the demo 31.93 -> 32.28 (189 guesses paused, 128 read) where router took 34.88
AUTO_THROTTLE = Throttle(precision=0.8, window=64, cooldown=64, growth=4, max_cooldown=4096)


class PrefetchTracker:
    """What the store needs to decide whether to prefetch, and what it reports about prefetching."""

    def __init__(self, throttle: Throttle = ROUTER_THROTTLE) -> None:
        self.throttle = throttle
        self.deferred: tuple[int, list[int]] | None = None  # (layer, experts) to issue after the next acquire
        self.predicted: dict[int, set[int]] = {}  # layer -> experts the prerouter predicted for it
        self.outstanding: set[tuple[int, int]] = set()  # brought in by prefetch, not used yet
        self.issued = self.used = self.wasted = self.paused = 0
        # a prompt's read-ahead (StreamingExpertStore.prefetch(prompt=True)): counted apart, no throttle
        self.prompt_outstanding: set[tuple[int, int]] = set()
        self.prompt_issued = self.prompt_used = self.prompt_wasted = 0
        self.predicted_true = self.true_total = 0  # prerouter recall: predicted & true / true
        self._guessed: dict[int, list[int]] = {}  # layer -> the experts its last guess read (decode)
        self._outcomes: deque[int] = deque()  # the throttle's window: 1 a guessed read the next acquire used, else 0
        self._right = 0  # sum(self._outcomes)
        self._cooldown = 0  # guesses left to skip
        self._next_cooldown = throttle.cooldown

    def defer(self, layer: int, experts: Sequence[int]) -> None:
        self.deferred = (layer, list(experts))

    def take_deferred(self) -> tuple[int, list[int]] | None:
        out, self.deferred = self.deferred, None
        return out

    def routed(self, layer: int, experts: Sequence[int]) -> None:
        """The true router chose `experts` of `layer`: score the prediction made for it and the reads guessed for it,
        if any."""
        predicted = self.predicted.pop(layer, None)
        if predicted is not None:
            self.true_total += len(experts)
            self.predicted_true += sum(e in predicted for e in experts)
        guessed = self._guessed.pop(layer, None)
        if guessed:
            chosen = set(experts)
            window, out = self.throttle.window, self._outcomes
            for e in guessed:
                hit = int(e in chosen)
                out.append(hit)
                self._right += hit
                if len(out) > window:
                    self._right -= out.popleft()

    def want(self) -> bool:
        """Whether the next decode guess is wanted: False while the throttle pauses (each call counts one paused
        guess), so the model does not compute it."""
        if self._cooldown > 0:
            self._cooldown -= 1
            self.paused += 1
            return False
        return True

    def allow(self, layer: int, experts: Sequence[int]) -> bool:
        """Record the prediction; False while the throttle pauses prefetching, or when the last window of guessed
        reads falls under its precision (the pause starts)."""
        if not self.want():
            return False
        self.noted(layer, experts)
        return self.admit()

    def noted(self, layer: int, experts: Sequence[int]) -> None:
        """The prediction for `layer` (its recall is scored at the layer's acquire)."""
        self.predicted[layer] = set(experts)

    def admit(self) -> bool:
        """allow's throttle once the guess is wanted (want): False when the last window of guessed reads falls under
        its precision (the pause starts). It does not depend on the guess: a guess computed later is noted after."""
        t = self.throttle
        if len(self._outcomes) >= t.window:
            if self._right < t.precision * len(self._outcomes):
                self._outcomes.clear()
                self._right = 0
                self._guessed.clear()
                self._cooldown = self._next_cooldown
                self._next_cooldown = min(t.max_cooldown, self._next_cooldown * t.growth)
                return False
            self._next_cooldown = t.cooldown
        return True

    def placed(self, keys: Sequence[tuple[int, int]], prompt: bool = False) -> None:
        if prompt:
            self.prompt_outstanding.update(keys)
            self.prompt_issued += len(keys)
            return
        self.outstanding.update(keys)
        self.issued += len(keys)
        if keys:
            self._guessed[keys[0][0]] = [e for _, e in keys]

    def hits(self, layer: int, experts: Sequence[int], missed: Container[int]) -> None:
        """An acquire used `experts` of `layer`, those at positions in `missed` read for it: each other one a prefetch
        brought was a right prefetch."""
        prompt, guessed = self.prompt_outstanding, self.outstanding
        if not prompt and not guessed:
            return
        for j, e in enumerate(experts):
            if j in missed:
                continue
            key = (layer, e)
            if key in prompt:
                prompt.discard(key)
                self.prompt_used += 1
            elif key in guessed:
                guessed.discard(key)
                self.used += 1

    def evicted(self, key: tuple[int, int]) -> None:
        """`key` left the cache: if a prefetch brought it and nobody used it, that read was wasted."""
        if key in self.prompt_outstanding:
            self.prompt_outstanding.discard(key)
            self.prompt_wasted += 1
        elif key in self.outstanding:
            self.outstanding.discard(key)
            self.wasted += 1

    def stats(self, expert_nbytes: int) -> dict:
        return {
            "prefetch_issued": self.issued,
            "prefetch_used": self.used,
            "prefetch_wasted": self.wasted,
            "prefetch_wasted_bytes": self.wasted * expert_nbytes,
            "prefetch_precision": round(self.used / self.issued, 4) if self.issued else 0.0,
            "prefetch_paused": self.paused,
            "prefetch_recall": round(self.predicted_true / self.true_total, 4) if self.true_total else 0.0,
            "prompt_prefetch_issued": self.prompt_issued,
            "prompt_prefetch_used": self.prompt_used,
            "prompt_prefetch_wasted": self.prompt_wasted,
        }
