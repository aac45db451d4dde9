"""Which cached expert to evict: the streaming store's policy, a class a test can build and swap.

A policy keeps the map (layer, expert) -> slot of what is cached and picks victims; the store owns the slots, the
pins, the reads in flight and the free list, and asks `victim(layer, usable)` only when no slot is free.

`FairShareLFU` (the default) is LRU with a per-layer fair share and, within a layer, the least used expert.
Layers are visited cyclically, so when the cache is smaller than one token's working set (layers x top_k experts)
a plain global LRU evicts every layer's experts just before they are needed again: measured 0.0% hits on a
23-layer, 64-expert, top-8 synthetic model with 150 slots, 12 greedy tokens; the fair share gets 5.8% there
(routing of that model is near-uniform, so ~9% is the decode ceiling; command: `sluice run
benchmarks/models/qwen3_moe-4GiB --memory 640MiB --max-tokens 12`). So a layer that already holds its share
(slots // MoE layers) replaces one of its own experts; a layer under its share takes the globally least recently
used expert of a layer above its share (shares leave room for the working layer's top_k).

Within a layer the victim is the expert with the lowest decayed use count (each use adds 1; every acquire of the
layer multiplies its counts by DECAY), the least recently used among equals. A trained router has favourite
experts; recency alone evicts a favourite after a short absence. Simulated on the demo model's decode routing over
3,000 held-out tokens (6 layers, 32 experts top-4): 52.4% -> 61.7% hits at 6 slots per layer, 63.9% -> 72.3% at 8
(Belady's optimum: 66.7%, 77.6%); on random routing (the synthetic models) both give the same hit rate. In the
engine, 256 greedy tokens of the demo model inflated to 1.5 GiB under --memory 384MiB (47 slots): 58.3% -> 68.7%
hits, 20.3 -> 15.2 GiB read, 86.6 -> 74.9 ms/token, same tokens (`sluice run benchmarks/models/demo-1.5GiB --prompt
"The for statement in Python differs a bit from what you may be used to in C or Pascal." --max-tokens 256 --memory
384MiB --io direct --odirect`, one run each).

`GlobalLRU` is the plain policy, kept as the baseline the tests compare against.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from collections.abc import Callable, Iterator, Sequence

Key = tuple[int, int]  # (layer, expert)
Usable = Callable[[Key, int], bool]  # may this (key, slot) be evicted now? (not pinned, not being placed)


def fair_share(slots: int, top_k: int, layers: int) -> int:
    """Each MoE layer's fair share of `slots`: what is left after the working layer's top_k, split evenly over
    `layers`. (An even split of all slots cascades: the working layer's top_k - share extra slots come out of the next
    layer's share, which then arrives empty and steals from the one after it; measured 0 hits on a 6-layer sweep.)"""
    return max(1, (slots - top_k) // max(1, layers))


class GlobalLRU:
    """Least recently used over all layers."""

    def __init__(self) -> None:
        self._lru: OrderedDict[Key, int] = OrderedDict()  # key -> slot, oldest first

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._lru)

    def slot(self, key: Key) -> int | None:
        """The slot holding `key`, None when not cached; no effect on the order."""
        return self._lru.get(key)

    def touch(self, key: Key) -> None:
        """`key` was used (a hit): most recent now."""
        self._lru.move_to_end(key)

    def used(self, layer: int, experts: Sequence[int]) -> None:
        """One acquire of `layer` asked for `experts` (hits and misses); frequency policies count them."""

    def insert(self, key: Key, slot: int) -> None:
        self._lru[key] = slot

    def remove(self, key: Key) -> int:
        """Forget `key`; return its slot."""
        return self._lru.pop(key)

    def victim(self, layer: int, usable: Usable) -> Key | None:
        """The entry to evict for a new expert of `layer`, among the usable ones; None when none is."""
        return next((k for k, s in self._lru.items() if usable(k, s)), None)

    def victims(self, layer: int, n: int, usable: Usable) -> list[Key] | None:
        """The n entries that n calls of victim() would evict in turn for n new experts of `layer`, each inserted
        (and unusable: pinned) after its victim is removed, where the policy can name them at once; else None (the
        caller asks victim() n times)."""
        return None


class FairShareLFU(GlobalLRU):
    """Per-layer fair share; within a layer the lowest decayed use count (module docstring)."""

    DECAY = 0.99  # per acquire of a layer: a use 69 tokens ago counts half (0.95-0.999 all within 0.2 points)

    def __init__(self, layers: Sequence[int], num_experts: int, top_k: int, slots: int):
        super().__init__()
        self._by_layer: dict[int, OrderedDict[Key, int]] = {L: OrderedDict() for L in layers}
        self.quota = fair_share(slots, top_k, len(layers))
        # Decayed use counts without touching every entry per step: a use adds the layer's increment, which grows by
        # 1/DECAY per acquire; comparisons within a layer only need the ratios (rescaled before they overflow).
        self._score: dict[int, list[float]] = {L: [0.0] * num_experts for L in layers}
        self._increment: dict[int, float] = dict.fromkeys(layers, 1.0)
        # each key's place in the global order (larger: more recent). A layer's own dict is the global order
        # restricted to it, so the oldest entry of the layers above their share is the oldest of their first ones:
        # victim() compares those instead of walking the whole cache, which took 117 us a miss for a layer under its
        # share with 588 slots of 31 layers, 3 us now (`benchmarks/knobs.py victim`, before and after)
        self._clock = 0
        self._tick: dict[Key, int] = {}

    def _stamp(self, key: Key) -> None:
        self._clock += 1
        self._tick[key] = self._clock

    def touch(self, key: Key) -> None:
        super().touch(key)
        self._by_layer[key[0]].move_to_end(key)
        self._stamp(key)

    def used(self, layer: int, experts: Sequence[int]) -> None:
        inc = self._increment[layer] = self._increment[layer] / self.DECAY
        score = self._score[layer]
        for e in experts:
            score[e] += inc
        if inc > 1e200:  # rescale: same order, no overflow
            self._score[layer] = [v / inc for v in score]
            self._increment[layer] = 1.0

    def insert(self, key: Key, slot: int) -> None:
        if key not in self._tick:  # a key set again keeps its place, as in the OrderedDicts
            self._stamp(key)
        super().insert(key, slot)
        self._by_layer[key[0]][key] = slot

    def remove(self, key: Key) -> int:
        del self._by_layer[key[0]][key]
        del self._tick[key]
        return super().remove(key)

    def victim(self, layer: int, usable: Usable) -> Key | None:
        own = self._by_layer[layer]
        if len(own) >= self.quota:
            keys, scores = self._scores(layer)
            # the least used entry, found without calling `usable` per entry (min and index run in C; index finds
            # the first of equals: the least recent, `own` being oldest first), then asked once; only when it is not
            # usable (pinned by this very acquire) the others are asked, in order of use (_by_use). Asking every entry
            # was 40 calls of the store's lambda per miss: 0.43 s of victim() in 40 profiled tokens, 11 ms a 599 ms
            # token (benchmarks/results/hybrid/step_profile.txt, stream)
            key = keys[scores.index(min(scores))]
            if usable(key, own[key]):
                return key
            # The least used is pinned for a third of a streamed decode's victims on the issue-30 model (an expert
            # this acquire asked for, counted once, where the others were counted several times; 3,974 of 11,770 in
            # 48 tokens, benchmarks/results/hybrid/victim-paths.txt)
            key = next(self._by_use(own, keys, scores, usable), None)
            if key is not None:
                return key
        return self._oldest_above_share(layer, usable)

    def victims(self, layer: int, n: int, usable: Usable) -> list[Key] | None:
        """victim()'s n choices at once where the layer holds its share: each call would evict the first usable
        entry of the layer's entries sorted by use count (oldest first among equals); the new experts it inserts are
        pinned, and removing an entry keeps the others' order, so the n calls take the first n usable entries of one
        sort. One sort a layer where each miss took its own (a streamed decode token of the issue-30 model: 236
        victims, ~40 entries a layer). None when the layer is under its share (its victims come from other layers
        and it grows to its share on the way) or has fewer than n usable entries."""
        own = self._by_layer[layer]
        if len(own) < self.quota or n > len(own):
            return None
        if n <= 0:
            return []
        out = list(islice(self._by_use(own, *self._scores(layer), usable), n))
        return out if len(out) == n else None

    def _scores(self, layer: int) -> tuple[list[Key], list[float]]:
        """The layer's keys, oldest first, and their decayed use counts."""
        score = self._score[layer]
        keys = list(self._by_layer[layer])
        return keys, [score[e] for _, e in keys]

    @staticmethod
    def _by_use(own: OrderedDict, keys: list[Key], scores: list[float], usable: Usable) -> Iterator[Key]:
        """own's usable entries (keys and scores as _scores gives them), least used first, the oldest first among
        equals (a stable sort of keys, oldest first): `usable` asked once per entry passed, not once per entry."""
        for i in sorted(range(len(keys)), key=scores.__getitem__):
            if usable(keys[i], own[keys[i]]):
                yield keys[i]

    def _oldest_above_share(self, layer: int, usable: Usable) -> Key | None:
        best = None  # the globally oldest usable entry of a layer above its share
        for d in self._by_layer.values():
            if len(d) > self.quota:
                key = next((k for k, s in d.items() if usable(k, s)), None)
                if key is not None and (best is None or self._tick[key] < self._tick[best]):
                    best = key
        return best if best is not None else super().victim(layer, usable)
