"""Prefetch bookkeeping of the streaming store: deferred predictions, the throttle, and its counters.

The prerouter predicts layer L+1's experts from the hidden state after layer L's attention. The reads are issued
right after layer L's own experts are pinned (so a prefetch can never evict what the current layer is about to
use, and the reads overlap layer L's expert math): `defer` keeps the prediction until the store's next acquire.

Throttle: outcomes (1 used, 0 wasted) of recent prefetches; when precision over a full window drops below
MIN_PRECISION, prefetch pauses for COOLDOWN calls (wasted reads compete with demand reads for the same disk),
then tries again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class PrefetchTracker:
    """What the store needs to decide whether to prefetch, and what it reports about prefetching."""

    WINDOW = 128
    MIN_PRECISION = 0.2
    COOLDOWN = 64

    def __init__(self) -> None:
        self.deferred: tuple[int, list[int]] | None = None  # (layer, experts) to issue after the next acquire
        self.predicted: dict[int, set[int]] = {}  # layer -> experts the prerouter predicted for it
        self.outstanding: set[tuple[int, int]] = set()  # brought in by prefetch, not used yet
        self.issued = self.used = self.wasted = self.paused = 0
        # a prompt's read-ahead (StreamingExpertStore.prefetch(prompt=True)): counted apart, no throttle
        self.prompt_outstanding: set[tuple[int, int]] = set()
        self.prompt_issued = self.prompt_used = self.prompt_wasted = 0
        self.predicted_true = self.true_total = 0  # prerouter recall: predicted & true / true
        self._outcomes: deque[int] = deque(maxlen=self.WINDOW)
        self._cooldown = 0

    def defer(self, layer: int, experts: Sequence[int]) -> None:
        self.deferred = (layer, list(experts))

    def take_deferred(self) -> tuple[int, list[int]] | None:
        out, self.deferred = self.deferred, None
        return out

    def routed(self, layer: int, experts: Sequence[int]) -> None:
        """The true router chose `experts` of `layer`: score the prediction made for it, if any."""
        predicted = self.predicted.pop(layer, None)
        if predicted is not None:
            self.true_total += len(experts)
            self.predicted_true += sum(e in predicted for e in experts)

    def allow(self, layer: int, experts: Sequence[int]) -> bool:
        """Record the prediction; False while the throttle pauses prefetching."""
        self.predicted[layer] = set(experts)
        if self._cooldown > 0:
            self._cooldown -= 1
            self.paused += 1
            return False
        if len(self._outcomes) == self.WINDOW and sum(self._outcomes) < self.MIN_PRECISION * self.WINDOW:
            self._outcomes.clear()
            self._cooldown = self.COOLDOWN
            return False
        return True

    def placed(self, keys: Sequence[tuple[int, int]], prompt: bool = False) -> None:
        if prompt:
            self.prompt_outstanding.update(keys)
            self.prompt_issued += len(keys)
            return
        self.outstanding.update(keys)
        self.issued += len(keys)

    def hit(self, key: tuple[int, int]) -> None:
        """An acquire used `key`: if a prefetch brought it, that prefetch was right."""
        if key in self.prompt_outstanding:
            self.prompt_outstanding.discard(key)
            self.prompt_used += 1
        elif key in self.outstanding:
            self.outstanding.discard(key)
            self.used += 1
            self._outcomes.append(1)

    def evicted(self, key: tuple[int, int]) -> None:
        """`key` left the cache: if a prefetch brought it and nobody used it, that read was wasted."""
        if key in self.prompt_outstanding:
            self.prompt_outstanding.discard(key)
            self.prompt_wasted += 1
        elif key in self.outstanding:
            self.outstanding.discard(key)
            self.wasted += 1
            self._outcomes.append(0)

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
