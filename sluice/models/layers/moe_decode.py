"""A decode token's MoE block (T == 1) in two native calls a layer around the store's acquire: the router's top k
(quant/native/moe_decode.py DecodeRoute), then the experts, the shared expert and the weighted sum
(DecodeExperts). The same arithmetic as layers/moe.py's one-token path (the same C functions in the same order:
the same bits), without its ~10 hand-offs from Python a layer: a resident MoE block of the issue-30 UD file took
~480 us of which the experts' kernels were ~300 (Intel Xeon VM, 2 cores: benchmarks/results/hybrid/moe-decode.txt).

A streamed token's layer whose experts are all in memory goes through the store in one more native call
(store/stream_decode.py run_layer: the acquire, these experts, the next layer's guessed reads, the release); one with
an expert still being read takes the acquire it did and goes on as below.

For a layer whose experts run as one native call each (q8.ExpertCall: quantized, an integer path, silu GLU), a
softmax router, a bf16 model, a shared expert absent or computed with the routed ones (MoE._fused_shared); other
layers keep moe.py's path."""

from __future__ import annotations

import torch

from ...quant import native
from ...quant.native.moe_decode import MAX_K, DecodeExperts, DecodeRoute
from ..routing import top_of_probs


class MoEDecode:
    """Layer L's one-token MoE block; `of` says whether the layer has one."""

    def __init__(self, moe, route: DecodeRoute, experts: DecodeExperts):
        self.moe, self.route, self.experts = moe, route, experts
        self.L, self.store, self.spec = moe.L, moe.experts.store, moe.spec
        self.fusable = getattr(self.store, "fusable", None)  # a streaming store's one-call layer (run_layer)

    @classmethod
    def of(cls, moe, b) -> "MoEDecode | None":
        """The layer's decode block, or None where moe.py's path has to run it (see the module's docstring)."""
        s, math = moe.spec, moe.experts.math
        if not (moe.native_router and native.available() and b.dtype is torch.bfloat16 and s.top_k <= MAX_K
                and b.kernels.split_experts and getattr(math, "call", None) is not None
                and b.store.layout.plain_dtype is None and isinstance(moe.lw.router, torch.Tensor)
                and moe.lw.router.dtype is torch.bfloat16 and moe.lw.router.is_contiguous()
                and moe.lw.router_bias is None):
            return None
        if moe.shared is not None and moe.fused is None:
            return None  # a shared expert of its own calls (DenseMLP): moe.py's path overlaps it with the reads
        gate = moe.lw.shared_gate if moe.shared is not None else None
        if gate is not None and not (isinstance(gate, torch.Tensor) and gate.dtype is torch.bfloat16
                                     and gate.numel() == math.call.h and gate.is_contiguous()):
            return None
        c = b.compute
        route = DecodeRoute(moe.lw.router, s.top_k, s.norm_topk_prob, not s.router_weights_fp32, moe.ties,
                            path=c.path)
        return cls(moe, route, DecodeExperts(math.call, moe.fused, gate, s.top_k, c.planes, path=c.path))

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [1, H] bf16 -> the block's output [1, H], or None (before any acquire) where this step needs moe.py's
        path: the store holds fewer than top_k experts at once."""
        route, store, k = self.route, self.store, self.spec.top_k
        if store.max_batch < k:
            return None
        x = x.contiguous()
        if route(x):
            ids, w, at = route.sorted_ids(), route.weights, route.at
        else:  # a NaN, or a tie torch.topk must order: torch ranks the same probabilities, as moe.py does then
            weights, top = top_of_probs(self.spec, route.probs, x.dtype)
            top_l = top[0].tolist()
            order = sorted(range(k), key=top_l.__getitem__)
            ids, w, at = [top_l[j] for j in order], weights.contiguous(), torch.tensor(order, dtype=torch.int64)
        ex, L = self.experts, self.L
        out = torch.empty_like(x)
        # in ascending id: slot j holds the j-th smallest id, summed j-th; the next layer's guessed reads held back
        if self.fusable is not None and (raw := self.fusable(L)) is not None:
            # a streamed token: the acquire, the experts (all in memory), the guess's reads and the release in one
            # native call (store/stream.c sluice_stream_layer); else it leaves the acquire done, as below
            ex.check_raw(raw)
            batch = store.run_layer(L, ids, ex.prepared(raw, x, w, at, out))
            if batch is None:
                return out
        else:
            batch = store.acquire(L, ids, hold=True)
        try:
            raw = batch.raw
            ex.check_raw(raw)
            slots = batch.slots
            # the ones in memory: hits, and guessed reads landed since (waited for at once: a read's error raises)
            now = range(k)
            if batch.pending:
                now = [j for j in now if batch.arrived(j)]
                for j in now:
                    batch.wait(j)
            if len(now) == k:  # every expert in memory (always, resident): one call
                if not store.deferred:
                    ex.run(raw, slots, list(now), x, True, True, k, w, at, out)
                    return out
                # the guessed reads queued while the pool's workers start on the experts (their Python, ~140 us a
                # layer of a streamed token, was the model thread's alone, the workers waiting)
                ex.start(raw, slots, x, w, at, out)
                try:
                    store.issue_deferred()
                finally:
                    ex.finish()
                return out
            store.issue_deferred()
            # those in memory in one call, then the others as their reads land, each call taking every one landed by
            # then; the sum with the last
            late = [j for j in range(k) if not batch.ready(j)]
            ex.run(raw, [slots[j] for j in now], now, x, True, True)
            while late:
                batch.wait(late[0])
                n = 1
                while n < len(late) and batch.arrived(late[n]):
                    batch.wait(late[n])
                    n += 1
                go, late = late[:n], late[n:]
                ex.run(raw, [slots[j] for j in go], go, x, False, False, 0 if late else k, w, at, out)
            return out
        finally:
            store.release(L)
