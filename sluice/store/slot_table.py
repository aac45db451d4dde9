"""The streaming store's slot table: which (layer, expert) each slot holds, the free slots, the pinned ones, and the
eviction policy's choices when an acquire's misses or a guess's reads need slots.

Two implementations, one interface (tests/store/test_slot_table.py drives both with the same random acquire / guess /
drop sequences and compares every slot they choose):
- `PolicySlots`: Python, over any policy of store/policy.py (a test's GlobalLRU, FairShareLFU), the reference;
- `NativeSlots`: slots.c, FairShareLFU's choices in C, the default where the extension is built: the policy's
  victims alone took ~80 us of the model's thread a call in Python, 3.2-3.4 ms of a ~54 ms streamed token of the
  issue-32 UD file on the AMD EPYC VM (benchmarks/results/hybrid/fused-guess.txt); the table's three calls take 1.4 ms
  a token on the Intel VM where the victims took 2.4 (func-cpu-intel.txt; A/B in slot-table.txt).

The table evicts; the store does what an eviction means for the reads (a guessed read still in flight lands before
its slot is reused) and counts it: `acquire` and `prefetch` return the keys they evicted.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Iterator, Sequence

import numpy as np

from .policy import FairShareLFU, GlobalLRU, Key, fair_share

_i32, _ptr = ctypes.c_int32, ctypes.c_void_p


#: an acquire's miss with every slot pinned (the tables' RuntimeError, NativeStream's StreamRefused)
NO_SLOT = "no unpinned slot left for a miss (acquire asks for at most max_batch)"


def bad_ids(call: str, layer: int, experts, num_experts: int) -> ValueError:
    """The error of an acquire's ids (`call` "acquire": repeated or out of range) or a prefetch's ("prefetch": out of
    range), for NativeSlots and NativeStream alike; `experts` a sequence or an int array."""
    ids = experts.tolist() if hasattr(experts, "tolist") else list(experts)
    why = "repeat or are out of range" if call == "acquire" else "out of range"
    return ValueError(f"{call} of layer {layer}: expert ids {ids} {why} (0..{num_experts - 1})")


class PolicySlots:
    """The slot table in Python over `policy` (store/policy.py)."""

    def __init__(self, policy: GlobalLRU, slots: int):
        self.policy = policy
        self.quota = getattr(policy, "quota", None)
        self._owner: list[Key | None] = [None] * slots
        self.free = list(range(slots - 1, -1, -1))  # a stack: the last one is taken first
        self.pinned: set[int] = set()
        self._usage = None

    def count_into(self, usage: np.ndarray) -> None:
        """used() adds each expert's use to usage[layer, expert] (int64 [layers, experts]) from now on."""
        self._usage = usage

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def __iter__(self) -> Iterator[Key]:
        return iter(self.policy)

    def slot(self, key: Key) -> int | None:
        return self.policy.slot(key)

    def owner(self, slot: int) -> Key | None:
        return self._owner[slot]

    def unpin_all(self) -> None:
        self.pinned.clear()

    def remove(self, key: Key) -> int:
        """Forget `key`; its slot (not made free: push_free)."""
        slot = self.policy.remove(key)
        self._owner[slot] = None
        return slot

    def push_free(self, slot: int) -> None:
        self.free.append(slot)

    def set_free(self, slots: list[int]) -> None:
        self.free = list(slots)

    def acquire(self, layer: int, experts: Sequence[int]) -> tuple[list[int], list[int], list[Key]]:
        """Pin the hits, then place and pin each miss (a free slot, else the policy's victim); returns (each
        expert's slot, the positions j of the misses, the keys evicted in order)."""
        policy, pinned = self.policy, self.pinned
        slots: list = [policy.slot((layer, e)) for e in experts]
        pinned.update(s for s in slots if s is not None)  # before any miss is placed: no miss evicts a hit
        missed = [j for j, s in enumerate(slots) if s is None]
        evicted: list[Key] = []
        if missed:
            chosen = self._victims(layer, len(missed), None, evicted)
            for i, j in enumerate(missed):
                slot = chosen[i] if chosen is not None else self._victim(layer, None, evicted)
                if slot is None:
                    raise RuntimeError(NO_SLOT)
                self._insert((layer, experts[j]), slot)
                pinned.add(slot)
                slots[j] = slot
        return slots, missed, evicted

    def used(self, layer: int, experts: Sequence[int], missed: Sequence[int]) -> None:
        """After an acquire's reads are queued: each expert counted (count_into's array, the policy's counts), each
        hit made the most recent, in order."""
        if self._usage is not None:
            row = self._usage[layer]
            for e in experts:
                row[e] += 1
        self.policy.used(layer, experts)
        missed_set = set(missed)
        for j, e in enumerate(experts):
            if j not in missed_set:
                self.policy.touch((layer, e))

    def prefetch(self, layer: int, experts: Sequence[int]) -> tuple[list[tuple[int, int]], list[Key]]:
        """Place a guess's experts that are not in memory (first occurrence of each), never evicting a pinned slot, a
        predicted expert in memory nor one placed here, until no slot is left; returns ((expert, slot) placed, the
        keys evicted)."""
        keep: set[Key] = {(layer, e) for e in experts if (layer, e) in self.policy}
        todo = [e for e in dict.fromkeys(experts) if (layer, e) not in keep]
        evicted: list[Key] = []
        entries: list[tuple[int, int]] = []
        # their victims from one sort where the policy can (the entries placed here are unusable to it as pinned
        # ones are)
        chosen = self._victims(layer, len(todo), keep, evicted) if todo else None
        for i, e in enumerate(todo):
            slot = chosen[i] if chosen is not None else self._victim(layer, keep, evicted)
            if slot is None:
                break
            keep.add((layer, e))
            self._insert((layer, e), slot)
            entries.append((e, slot))
        return entries, evicted

    def _insert(self, key: Key, slot: int) -> None:
        self.policy.insert(key, slot)
        self._owner[slot] = key

    def _victim(self, layer: int, keep: set | None, evicted: list) -> int | None:
        """A slot for an expert of `layer`: a free one, else the policy's victim (never pinned nor kept), evicted."""
        if self.free:
            return self.free.pop()
        pinned, keep = self.pinned, keep or set()
        key = self.policy.victim(layer, lambda k, slot: slot not in pinned and k not in keep)
        if key is None:
            return None
        evicted.append(key)
        return self.remove(key)

    def _victims(self, layer: int, n: int, keep: set | None, evicted: list) -> list[int] | None:
        """n slots at once where the policy names them (policy.victims), evicted; None when a slot is free or it
        cannot (the caller then asks _victim per expert)."""
        if self.free:
            return None
        pinned = self.pinned
        if keep:
            usable = lambda k, slot: slot not in pinned and k not in keep  # noqa: E731
        else:
            usable = lambda k, slot: slot not in pinned  # noqa: E731
        keys = self.policy.victims(layer, n, usable)
        if keys is None:
            return None
        evicted.extend(keys)
        return [self.remove(k) for k in keys]


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("sluice.store._slots")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    for name, args, res in (
            ("sluice_slots_open", [_i32, _i32, _i32, _i32], _ptr), ("sluice_slots_close", [_ptr], None),
            ("sluice_slots_acquire", [_ptr, _i32, _ptr, _i32, _ptr, _ptr, _ptr, _ptr], _i32),
            ("sluice_slots_used", [_ptr, _i32, _ptr, _i32, _ptr, _ptr], None),
            ("sluice_slots_prefetch", [_ptr, _i32, _ptr, _i32, _ptr, _ptr, _ptr, _ptr], _i32),
            ("sluice_slots_remove", [_ptr, _i32], _i32), ("sluice_slots_slot", [_ptr, _i32], _i32),
            ("sluice_slots_owner", [_ptr, _i32], _i32), ("sluice_slots_keys", [_ptr, _ptr], _i32),
            ("sluice_slots_count", [_ptr], _i32), ("sluice_slots_unpin_all", [_ptr], None),
            ("sluice_slots_pinned", [_ptr, _ptr], _i32), ("sluice_slots_get_free", [_ptr, _ptr], _i32),
            ("sluice_slots_set_free", [_ptr, _ptr, _i32], _i32),
            ("sluice_slots_push_free", [_ptr, _i32], _i32)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


LIB = _load()


def native_available() -> bool:
    return LIB is not None


class _Pinned:
    """NativeSlots.pinned: the pinned slots as a read-only set-like view (tests and the store's checks)."""

    def __init__(self, table: "NativeSlots"):
        self._t = table

    def _list(self) -> list[int]:
        t = self._t
        return t._out[: LIB.sluice_slots_pinned(t._h, t._out_p)].tolist()

    def __contains__(self, slot: object) -> bool:
        return slot in self._list()

    def __iter__(self) -> Iterator[int]:
        return iter(self._list())

    def __len__(self) -> int:
        return len(self._list())

    def __bool__(self) -> bool:
        return bool(self._list())


class NativeSlots:
    """PolicySlots over FairShareLFU, in slots.c (module docstring). `layers`: the MoE layers (ids < n_layers)."""

    def __init__(self, layers: Sequence[int], n_layers: int, num_experts: int, top_k: int, slots: int):
        self.quota = fair_share(slots, top_k, len(layers))  # FairShareLFU's
        self._experts, self._slots, self._layers = num_experts, slots, n_layers
        self._usage, self._usage_p = None, 0
        self._h = LIB.sluice_slots_open(n_layers, num_experts, slots, self.quota)
        if not self._h:
            raise MemoryError(f"the slot table of {slots} slots over {n_layers} x {num_experts} experts")
        # per-call arrays, made once: inputs and outputs of up to max(slots, experts) entries
        cap = max(slots, num_experts)
        self._in = np.zeros(cap, dtype=np.int32)
        self._slot_out = np.zeros(cap, dtype=np.int32)
        self._missed = np.zeros(cap, dtype=np.uint8)
        self._evicted = np.zeros(cap, dtype=np.int32)
        self._out = np.zeros(cap, dtype=np.int32)
        self._n = np.zeros(1, dtype=np.int32)
        self._in_p, self._slot_p, self._missed_p, self._ev_p, self._out_p, self._n_p = (
            a.ctypes.data for a in (self._in, self._slot_out, self._missed, self._evicted, self._out, self._n))
        self.pinned = _Pinned(self)
        self._last: tuple = (None, None)  # the last acquire's experts and missed lists

    def _key(self, k: int) -> Key:
        return divmod(k, self._experts)

    def _code(self, key: Key) -> int:
        layer, e = key
        return layer * self._experts + e if 0 <= e < self._experts and layer >= 0 else -1

    def _put(self, experts: Sequence[int]) -> int:
        self._last = (None, None)  # the inputs change
        n = len(experts)
        if n > len(self._in):
            raise ValueError(f"{n} experts in one call > {len(self._in)}")
        self._in[:n] = experts
        return n

    def __contains__(self, key: object) -> bool:
        return LIB.sluice_slots_slot(self._h, self._code(key)) >= 0

    def __len__(self) -> int:
        return LIB.sluice_slots_count(self._h)

    def __iter__(self) -> Iterator[Key]:
        """The cached keys, oldest first."""
        n = LIB.sluice_slots_keys(self._h, self._out_p)
        return iter([self._key(k) for k in self._out[:n].tolist()])

    def slot(self, key: Key) -> int | None:
        s = LIB.sluice_slots_slot(self._h, self._code(key))
        return None if s < 0 else s

    def owner(self, slot: int) -> Key | None:
        k = LIB.sluice_slots_owner(self._h, slot)
        return None if k < 0 else self._key(k)

    def unpin_all(self) -> None:
        LIB.sluice_slots_unpin_all(self._h)

    def remove(self, key: Key) -> int:
        slot = LIB.sluice_slots_remove(self._h, self._code(key))
        if slot < 0:
            raise KeyError(key)
        return slot

    @property
    def free(self) -> list[int]:
        return self._out[: LIB.sluice_slots_get_free(self._h, self._out_p)].tolist()

    def push_free(self, slot: int) -> None:
        if LIB.sluice_slots_push_free(self._h, slot):
            raise ValueError(f"free slot {slot}: out of range, holding an expert or free already")

    def set_free(self, slots: list[int]) -> None:
        a = np.asarray(slots, dtype=np.int32)
        if LIB.sluice_slots_set_free(self._h, a.ctypes.data, len(a)):
            raise ValueError(f"free slots {slots}: out of range, repeated or holding an expert")

    def acquire(self, layer: int, experts: Sequence[int]) -> tuple[list[int], list[int], list[Key]]:
        n = self._put(experts)
        m = LIB.sluice_slots_acquire(self._h, layer, self._in_p, n, self._slot_p, self._missed_p, self._ev_p,
                                     self._n_p)
        if m == -2:
            raise bad_ids("acquire", layer, experts, self._experts)
        if m < 0:
            raise RuntimeError(NO_SLOT)
        slots = self._slot_out[:n].tolist()
        missed = [j for j, f in enumerate(self._missed[:n].tobytes()) if f] if m else []  # ~1 us less than numpy's
        self._last = (experts, missed)  # (used() knows its flags by these very objects)
        ne = int(self._n[0])
        return slots, missed, [self._key(k) for k in self._evicted[:ne].tolist()] if ne else []

    def count_into(self, usage: np.ndarray) -> None:
        if usage.dtype != np.int64 or usage.shape != (self._layers, self._experts) or not usage.flags.c_contiguous:
            raise ValueError(f"usage counts: int64 [{self._layers}, {self._experts}], contiguous")
        self._usage = usage  # kept alive: C writes into it
        self._usage_p = usage.ctypes.data

    def used(self, layer: int, experts: Sequence[int], missed: Sequence[int]) -> None:
        if missed is self._last[1] and experts is self._last[0]:  # the last acquire's lists: its flags are in place
            n = len(experts)
        else:
            n = self._put(experts)
            self._missed[:n] = 0
            self._missed[missed] = 1
        LIB.sluice_slots_used(self._h, layer, self._in_p, n, self._missed_p, self.usage_row(layer))

    def usage_row(self, layer: int) -> int | None:
        """The address of `layer`'s row of the usage counts count_into gave (None: none given, or no such layer)."""
        return self._usage_p + 8 * layer * self._experts if self._usage_p and 0 <= layer < self._layers else None

    def prefetch(self, layer: int, experts: Sequence[int]) -> tuple[list[tuple[int, int]], list[Key]]:
        if len(experts) > len(self._in):  # repeats (the placement takes the first of each)
            experts = list(dict.fromkeys(experts))
        n = self._put(experts)
        m = LIB.sluice_slots_prefetch(self._h, layer, self._in_p, n, self._out_p, self._slot_p, self._ev_p,
                                      self._n_p)
        if m < 0:
            raise bad_ids("prefetch", layer, experts, self._experts)
        ne = int(self._n[0])
        return (list(zip(self._out[:m].tolist(), self._slot_out[:m].tolist())),
                [self._key(k) for k in self._evicted[:ne].tolist()] if ne else [])

    def close(self) -> None:
        h, self._h = self._h, None
        if h:
            LIB.sluice_slots_close(h)

    def __del__(self) -> None:
        if getattr(self, "_h", None) and LIB is not None:
            self.close()


def make_table(layers: Sequence[int], n_layers: int, num_experts: int, top_k: int, slots: int,
               policy: GlobalLRU | None = None) -> PolicySlots | NativeSlots:
    """The store's table: over `policy` in Python when one is given, else FairShareLFU in C where slots.c is built
    (in Python where it is not)."""
    if policy is not None:
        return PolicySlots(policy, slots)
    if native_available():
        return NativeSlots(layers, n_layers, num_experts, top_k, slots)
    return PolicySlots(FairShareLFU(layers, num_experts, top_k, slots), slots)
