"""In-process A/B of run_layer's bookkeeping on the model's thread (store/stream_decode.py): a layer done in the one
native call with its guess made there counted by two tracker calls (PrefetchTracker.routed answering the throttle
too, then PrefetchTracker.decoded: "now") against five (routed, admit, hits, noted, placed, each a call, as at
656df30: "before", its run_layer and _layer_guess copied below). The same counts (tests/store/test_stream_layer.py
compares them with the separate calls'). One model's greedy stream after [5, 6] (40 tokens skipped): each round, each
arm switched on, one token untimed, 16 timed, arm order rotated per round (benchmarks/common.py alternate_tokens).
--memory 640MiB, O_DIRECT, no cgroup, --prefetch auto.

    git apply benchmarks/results/hybrid/tracker-calls/tracker_calls.patch
    .venv/bin/python benchmarks/results/hybrid/tracker-calls/tracker_ab.py ROUNDS MODEL
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.store.streaming import StreamingExpertStore


# 656df30's (the "before" arm)
def run_layer(self, layer: int, experts: list[int], ctx: int) -> object:
    """A decode token's acquire of `layer`'s `experts` (ascending), and where every one is in memory, their math
    (ctx: DecodeExperts.prepared, into its out) while the deferred guess is made (guess_later's) and its reads
    queued, then release: one C call (stream.c sluice_stream_layer). None: done. Else the batch
    acquire(hold=True) returns (an expert missed, or its guessed read is in flight: the caller's math goes on as
    after acquire, then issue_deferred and release). Only where fusable(layer) said so."""
    if len(experts) > self.max_batch:
        raise ValueError(f"acquire of {len(experts)} experts > {self.max_batch} slots")
    stream, tracker = self._stream, self.prefetching
    tracker.routed(layer, experts)  # before the guess is allowed, as acquire then issue_deferred do
    nxt, guess, compute, late = self._layer_guess()
    rc = self._layer_call(stream, layer, experts, ctx, nxt, guess, compute)
    if compute is not None and rc:  # the guess's reads not queued in the call (made there, or made here)
        _, g, x, chosen = late
        how = stream.made()
        guess = stream.guessed(g.k) if how == 1 else chosen(g, g.probs if how == 2 else g(x))
        tracker.noted(nxt, guess)
        if not compute[-1]:
            guess = ()
    if guess and rc:
        self._allowed = (nxt, guess)  # not queued: issue_deferred queues it
    if rc == 2:  # a file changed (or the reader closed): nothing done, acquire's path names it
        self._batch, self._inflight = (-1, []), {}
        return self._acquire(layer, experts, True, routed=True)
    if rc == 1:  # the acquire done, an expert not in memory: the caller's math goes on as after acquire
        try:
            slots, missed = self._took(stream, layer, experts, self._inflight, *stream.acquired(len(experts)))
        except BaseException:
            self._fail()
            raise
        return self._acquired(layer, experts, slots, missed, self._inflight, True)
    self._inflight = {}
    self.hits += len(experts)
    tracker.hits(layer, experts, ())
    if compute is not None:  # the guess made in the call: noted; its reads queued there where admitted
        _, g, x, chosen = late
        ids = stream.guessed(g.k)
        if ids is None:  # torch.topk ranks it: its reads queued here (the layer is released already)
            tracker.noted(nxt, ids := chosen(g, g.probs))
            if compute[-1]:
                self._prefetch(nxt, ids)
            return None
        tracker.noted(nxt, ids)
        guess = ids if compute[-1] else ()
    if guess:
        self._layer_placed(stream, nxt)
    return None

def _layer_guess(self) -> tuple[int, list[int] | tuple, tuple | None, tuple | None]:
    """run_layer's guess: (its layer, its ids where made already, what stream.layer computes it from where not
    (guess_later's: its throttle first, which does not need the ids), guess_later's)."""
    tracker, late = self.prefetching, self._late
    if late is not None:
        self._late = None
        g = late[1]
        return late[0], (), (*g.packed(), late[2].data_ptr(), g.ids.data_ptr(), g.k, int(tracker.admit())), late
    if (deferred := tracker.take_deferred()) is not None and tracker.allow(*deferred):
        return *deferred, None, None
    return -1, (), None, None



now = {k: getattr(StreamingExpertStore, k) for k in ("run_layer", "_layer_guess")}
before = {"run_layer": run_layer, "_layer_guess": _layer_guess}


def arm(methods: dict):
    def on() -> None:
        for k, f in methods.items():
            setattr(StreamingExpertStore, k, f)
    return on


rounds, M = int(sys.argv[1]), sys.argv[2]
m, it = decode_stream(M, "auto")
res = alternate_tokens(it, {"before": arm(before), "now": arm(now)}, rounds)
print_paired(res, "before", "now", "auto tracker calls {arm}", "now")
s = m.store.stats()
print(f"hits {s['hits']} misses {s['misses']} prefetch issued {s['prefetch_issued']} used {s['prefetch_used']} "
      f"recall {s['prefetch_recall']:.4f}")
it.close()
m.close()
