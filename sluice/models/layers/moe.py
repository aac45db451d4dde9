"""The sparse MoE feed-forward block: the true router picks each token's top-k experts, the expert store hands their
slots over (hits from memory, misses read), the experts' math runs on them (layers/experts.py), and a shared expert
(qwen2_moe's, with its sigmoid gate; glm4_moe's and deepseek_v3's ungated) is added."""

from __future__ import annotations

import torch

from ...quant import native
from ...quant.linear import BF16_GEMM_MIN_ROWS
from ...quant.linear import QuantLinear
from ...quant.native import ops, prompt, q8
from ...quant.native.decode import router_probs_bf16, ties_exact, topk_probs
from ...quant.native.moe_decode import shared_weight
from ..linear import linear
from ..routing import route, top_of_probs
from .build import Build, Step
from .dense import DenseMLP
from .experts import EXPERT_Q8_MAX_ROWS, GEMM_ROW_STEP
from .moe_decode import MoEDecode


class MoE:
    """Layer L's MoE block: x [T, H] -> [T, H]."""

    def __init__(self, b: Build, L: int):
        self.spec, self.lw, self.L = b.spec, b.w.layers[L], L
        self.bf16, self.path = b.compute.bf16_gemm, b.compute.path
        # the softmax over the router's logits in one native call at decode (~10 us where F.linear and softmax took
        # ~60), where the decode step's attention runs natively too
        self.native_router = b.native_decode and b.spec.router == "softmax"
        # its ties in torch.topk's order natively where topk.cc matches torch here (checked once, at load: ~25 ms)
        self.ties = self.native_router and ties_exact()
        self.experts = Experts(b, L)
        self.shared = None if self.lw.shared is None else DenseMLP(b, self.lw.shared)
        self.fused = self._fused_shared(b)
        self._one = torch.ones(1, 1, dtype=torch.bfloat16)  # an ungated shared expert's weight
        # a decode token's block in two native calls where the layer allows (layers/moe_decode.py), else None
        self.decode = MoEDecode.of(self, b)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        lw = self.lw
        if x.shape[0] == 1 and self.decode is not None and x.dtype is torch.bfloat16:
            out = self.decode(x)
            if out is not None:
                return out
        if x.shape[0] == 1 and self.native_router:
            probs, s = router_probs_bf16(x, lw.router, path=self.path), self.spec
            top = topk_probs(probs, s.top_k, s.norm_topk_prob, None if s.router_weights_fp32 else x.dtype, self.ties)
            weights, ids = top if top is not None else top_of_probs(s, probs, x.dtype)  # None: torch ranks (a NaN;
            # a tie without topk.cc)
        else:
            weights, ids = route(self.spec, lw, x, self.bf16)  # [T, K] each
        side = None if self.shared is None else lambda: self._shared(x)
        fused = None
        if self.fused is not None and x.shape[0] == 1 and x.dtype is torch.bfloat16:
            fused = (self.fused, lambda: self._shared_weight(x))
        out, shared = self.experts(x, ids, weights, step, side, fused)
        return out if shared is None else out + shared

    def _fused_shared(self, b: Build) -> tuple | None:
        """q8.expert_args of the shared expert where a decode step computes it in its routed experts' native call
        (Experts._native: one more row of the same kernels, no call of its own), else None: gate, up and down
        quantized with an integer path, of the routed experts' [I, H], these computed one call each (GluMath.call)
        at bf16. Its term is added after the routed ones as bf16(bf16(y) * weight), weight sigmoid(gate x) or 1,
        which is what `out + shared` adds; y is expert_q8's (silu(g) * u in float32, coded once for down) where
        DenseMLP rounds g, u and their product to bf16 between three calls of their own: the two agree to bf16's
        precision, not bitwise (a prompt's rows keep DenseMLP). The shared expert's three calls and the torch ops
        between them were ~120 us of the model thread's a layer, resident, on the issue-30 model (AVX2 EPYC)."""
        sh, call = self.lw.shared, getattr(self.experts.math, "call", None)
        if sh is None or call is None or b.dtype is not torch.bfloat16:
            return None
        ws = (sh.gate, sh.up, sh.down)
        if not all(type(w) is QuantLinear and w.int8 for w in ws):  # int8: an integer path (q8.q8_supported)
            return None
        shapes = tuple((w.spec.out_features, w.spec.in_features) for w in ws)
        if shapes != ((call.i, call.h), (call.i, call.h), (call.h, call.i)):
            return None
        return q8.expert_args(tuple(w.spec for w in ws), tuple(w.raw for w in ws))[2]

    def _shared_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The fused shared expert's weight [1, 1] bf16: sigmoid(gate x), as _shared scales it, or 1; natively
        where the gate is a bf16 row (moe_decode.shared_weight: what MoEDecode adds, so a decode token's block has
        the same bits on either path)."""
        gate = self.lw.shared_gate
        if gate is None:
            return self._one
        if (native.available() and isinstance(gate, torch.Tensor) and gate.dtype is torch.bfloat16
                and gate.is_contiguous() and x.dtype is torch.bfloat16 and x.shape[0] == 1):
            return shared_weight(x.contiguous(), gate, path=self.path)
        return torch.sigmoid(linear(x, gate, None, self.bf16))

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's term [T, H], its sigmoid gate applied."""
        shared = self.shared(x)  # [T, H]
        gate = self.lw.shared_gate
        return shared if gate is None else torch.sigmoid(linear(x, gate, None, self.bf16)) * shared


class Experts:
    """Sum over each token's top-k experts of layer L, in ascending expert id (the reference's order, so bf16 sums
    match), their slots from the store."""

    def __init__(self, b: Build, L: int):
        self.L, self.store, self.spec, self.dtype = L, b.store, b.spec, b.dtype
        self.compute, self.kernels, self.workspace = b.compute, b.kernels, b.workspace
        self.math = b.expert_math[b.store.layout.format(L)]  # the format's math (layers/experts.py)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, step: Step,
                 side=None, fused=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H], ids/weights [T, K] -> ([T, H], side()). `side` (the shared expert's term, or None) runs
        once the first pass's misses are queued, so its math overlaps their reads instead of following them (the
        same ops on the same inputs: the same bits). `fused` (decode only): (q8.expert_args of the shared expert,
        its weight's function), computed with the routed experts instead of side where they run natively.
        Expert-major: the rows routed to each expert are gathered once
        into one expert-sorted block of T*K rows (plus zero rows padding GEMMs, GEMM_ROW_STEP), each expert runs
        once on its contiguous slice (its bytes read once for the whole chunk; experts come from the store in passes
        of at most `store.max_batch`, the ones in memory first, the rest as their reads land), each output
        overwrites its own input rows, and the k partial results of a token (rows found by (token, rank of its
        expert id among the token's k)) are added in ascending id, each from zeros: bitwise what the decode path
        (and an index_add_ per expert) computes, whatever order the experts ran in."""
        T, K = ids.shape
        if T == 1:
            return self._one_token(x, ids, weights, torch.zeros_like(x), side, fused)
        ranked, rank_of = torch.sort(ids, dim=1, stable=True)  # [T, K]: each token's ids ascending
        flat = ranked.flatten()  # [T*K], row t*K + r = token t's r-th smallest expert id
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, tokens ascending within one
        eids, counts = torch.unique_consecutive(flat[order], return_counts=True)
        rows = torch.arange(T * K)  # sorted position -> its row of the block
        if x.dtype is torch.bfloat16 and self.compute.bf16_gemm and not self.math.int8_rows:
            # each expert's rows padded to a multiple of GEMM_ROW_STEP where they go to a GEMM (see GEMM_ROW_STEP;
            # not for the int8 prompt kernels, which take any row count at one speed)
            padded = torch.where(counts >= BF16_GEMM_MIN_ROWS, (counts + GEMM_ROW_STEP - 1) // GEMM_ROW_STEP
                                 * GEMM_ROW_STEP, counts)
            rows += torch.repeat_interleave(torch.cumsum(padded - counts, 0) - (padded - counts), counts)
        else:
            padded = counts
        starts = (torch.cumsum(padded, 0) - padded).tolist()
        n_rows = int(padded.sum())
        eids, padded = eids.tolist(), padded.tolist()
        # One [n_rows, H] block holds the rows all the way: the expert-sorted inputs (padding rows zero), then each
        # expert's outputs written over its own (spent) input slice, then those outputs scaled in place; the
        # ascending-rank sum gathers from it into one reused [T, H] buffer. (It held 4 such blocks: inputs, outputs,
        # rank order and y * w; at 2,048 tokens of a top-8 H=1024 bf16 model each is 32 MiB.) Its capacity covers
        # the most padding any layer may bring, so it is allocated once per prompt.
        ys = self.workspace.rows(n_rows, x, T * K + self.spec.num_experts * (GEMM_ROW_STEP - 1))
        coded, tok = None, order // K  # tok: each sorted row's token
        if self.kernels.code_rows_once and n_rows == T * K and x.dtype is torch.bfloat16 and self.math.int8_whole:
            # the int8 prompt kernels code x once here, not once per expert for each of its k experts (each row's
            # codes are the same bytes either way); experts then gather their rows' codes, not their bf16 rows
            coded = prompt.code(x.contiguous(), planes=self.math.prompt_planes, path=self.compute.path)
        elif n_rows == T * K:
            torch.index_select(x, 0, tok, out=ys)
        else:  # padding rows read the zero row appended to x
            src = torch.full((n_rows,), T, dtype=torch.long).index_copy_(0, rows, order // K)
            torch.index_select(torch.cat([x, x.new_zeros(1, x.shape[1])]), 0, src, out=ys)
        side_term = self._run(eids, starts, padded, x, ys, coded, tok, step, side)
        w = torch.gather(weights, 1, rank_of).flatten()[order]  # [T*K] each sorted row's routing weight
        if n_rows != T * K:  # padding rows weigh nothing and are never summed
            w = torch.zeros(n_rows, dtype=w.dtype).index_copy_(0, rows, w)
        at = torch.empty_like(order).index_copy_(0, order, rows).view(T, K)  # (token, rank) -> row
        if native.available() and x.dtype is torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32):
            # the lines below in one call over the pool, the same bits (tests/quant/test_ops.py)
            return ops.combine_rows_bf16(ys, w, at, torch.empty_like(x), path=self.compute.path), side_term
        ys.mul_(w[:, None])  # y * w rounded to x.dtype once per element, as (ys * w).to(x.dtype) and T == 1 do
        out, part = torch.zeros_like(x), torch.empty_like(x)  # [T, H] each
        for r in range(K):
            out += torch.index_select(ys, 0, at[:, r], out=part)
        return out, side_term

    def _run(self, eids: list[int], starts: list[int], padded: list[int], x: torch.Tensor, ys: torch.Tensor,
             coded, tok: torch.Tensor, step: Step, side) -> torch.Tensor | None:
        """Each expert of eids on its rows of the block ys (in place), the store's passes of at most max_batch;
        returns side(), run once the first pass's reads are queued (None without a side)."""
        L, math, store = self.L, self.math, self.store
        side_term = None
        pass_size = max(1, store.max_batch)
        guess, step.prompt_guess = step.prompt_guess, None
        for c0 in range(0, len(eids), pass_size):
            chunk = eids[c0 : c0 + pass_size]
            batch = store.acquire(L, chunk)
            try:
                if side is not None and c0 == 0:
                    side_term = side()
                if guess is not None and len(eids) <= pass_size:  # one pass: the other slots may take the next layer's
                    store.prefetch(*guess, prompt=True)
                todo = sorted(range(len(chunk)), key=lambda j: not batch.ready(j))  # stable: ready ones first
                if coded is not None and getattr(math, "experts_call", None) is not None:
                    todo = self._run_many(batch, todo, c0, starts, padded, coded, tok, ys)
                for j in todo:
                    batch.wait(j)
                    a, n = starts[c0 + j], padded[c0 + j]
                    if coded is None:
                        ys[a : a + n] = math(batch, j, ys[a : a + n])
                    elif n > EXPERT_Q8_MAX_ROWS:
                        math.coded(batch, j, coded, tok[a : a + n], ys[a : a + n])
                    else:  # a few rows: the decode-style native call on the rows themselves
                        ys[a : a + n] = math(batch, j, x[tok[a : a + n]])
            finally:
                store.release(L)
        return side_term

    def _run_many(self, batch, todo: list[int], c0: int, starts: list[int], padded: list[int], coded,
                  tok: torch.Tensor, ys: torch.Tensor) -> list[int]:
        """The experts of todo with more than EXPERT_Q8_MAX_ROWS rows, in native calls of all those in memory at
        once (GluMath.coded_many: ready ones first, then whichever have landed each time the next is waited for);
        returns the rest (a few rows each) for the per-expert loop. Each expert writes only its own rows: the
        same bits in any order."""
        big = [j for j in todo if padded[c0 + j] > EXPERT_Q8_MAX_ROWS]
        while big:
            batch.wait(big[0])
            now = [j for j in big if batch.arrived(j)]  # big[0] and every other one already in
            for j in now:
                batch.wait(j)
            self.math.coded_many(batch, now, coded, tok, [starts[c0 + j] for j in now],
                                 [padded[c0 + j] for j in now], ys)
            big = [j for j in big if j not in now]
        return [j for j in todo if padded[c0 + j] <= EXPERT_Q8_MAX_ROWS]

    def _one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                   side=None, fused=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode (T == 1): the same arithmetic as the grouped path (ascending ids, y * w, add into zeros) without
        the grouping ops, which cost ~0.5 ms of Python per layer (profiled on a 16-layer model).

        Experts whose bytes are in memory run first, the rest as their reads land (batch.wait), so the math of
        one overlaps the reading of the next; the outputs are summed afterwards in ascending expert id, so the
        result is bitwise the same whatever the disk's timing. Experts that run as one native call each
        (GluMath.one_call) go to the native code together: those already in memory in one call, the others one
        call each as they land, the rows of every call split over the native threads (_native); the sum is the
        same, in the same order. Returns (out, side()), side run as in __call__; with `fused` and native experts,
        the shared expert is a row of the first pass's first call instead, added last (MoE._fused_shared), and
        side_term None.
        """
        L, store, math = self.L, self.store, self.math
        ids_l = ids[0].tolist()
        order = sorted(range(len(ids_l)), key=ids_l.__getitem__)  # top-k positions by ascending expert id
        pass_size = max(1, store.max_batch)
        xf = None  # x in float32, for the one-call native experts
        side_term = shared_y = None
        for c0 in range(0, len(order), pass_size):
            pos = order[c0 : c0 + pass_size]
            batch = store.acquire(L, [ids_l[k] for k in pos])
            try:
                native_path = batch.gate_up is None and batch.packed is None and math.one_call(1)
                extra = fused[0] if fused is not None and native_path and c0 == 0 else None
                if side is not None and c0 == 0 and extra is None:  # the misses' reads are queued: the shared
                    side_term = side()  # expert meanwhile
                # in memory first (stable): cached hits and guessed reads that have landed since acquire, waited for
                # now (at once; a read error raises here as it would below), so one native call runs them all where
                # the landed guesses took a second call of their own (~190 us a call)
                landed = [batch.arrived(j) for j in range(len(pos))]
                for j in range(len(pos)):
                    if landed[j]:
                        batch.wait(j)
                todo = sorted(range(len(pos)), key=lambda j: not landed[j])
                if native_path:
                    xf = x.float().contiguous() if xf is None else xf  # [1, H]
                    ys = self._native(batch, todo, xf, extra)  # [n (+1), H] float32, row j = expert j
                    if extra is not None:  # the shared expert's row, added after every routed one
                        ys, shared_y = ys[: len(pos)], ys[len(pos) :]
                    # as below, row by row: (y in the compute dtype) * w, rounded to out's dtype, added in id order
                    if out.dtype is torch.bfloat16 and self.dtype is torch.bfloat16 and weights.is_contiguous():
                        ops.combine_bf16(ys, weights, pos, out, path=self.compute.path)  # the same bits in one call
                        continue
                    ys = (ys.to(self.dtype) * weights[0, pos].unsqueeze(1)).to(out.dtype)
                    for j in range(len(pos)):
                        out += ys[j : j + 1]
                    continue
                yl: list[torch.Tensor | None] = [None] * len(pos)
                for j in todo:
                    batch.wait(j)
                    yl[j] = math(batch, j, x) * weights[:, pos[j] : pos[j] + 1]  # [1, H]
                for y in yl:
                    out += y.to(out.dtype)
            finally:
                store.release(L)
        if shared_y is not None:
            ops.combine_bf16(shared_y, fused[1](), [0], out, path=self.compute.path)
        return out, side_term

    def _native(self, batch, todo: list[int], xf: torch.Tensor, extra: tuple | None = None) -> torch.Tensor:
        """Experts `todo` (ready ones first) of batch on xf [1, H] float32 -> [n, H] float32 (row j = expert j).
        The ones in memory run in one native call, the others as their reads land (each call takes the one waited
        for and every later one already in; only this thread waits on the store); the C pool's threads split the
        rows of each call. Each row is bitwise what one expert_q8 call gives, whichever thread computed it.
        Kernels.split_experts False: one expert_q8 call per expert (tests compare the two; `benchmarks/knobs.py
        threads` times the decode step either way).

        Peers Q4_K_M, resident, a token's 128 experts (benchmarks/quantized/expert_threads.py, removed: its command
        is in benchmarks/results/quantized/README.md): 16.6-18.6 ms this way on two threads, 21.7-25.5 one
        expert_q8 call each on one thread, 25-29 split over a Python pool with one expert per job (the way
        before). `extra`: a shared expert's q8.expert_args, row n of ys, in the first call (alone when none is in
        memory: while the first miss loads)."""
        n_all = len(todo)
        ys = torch.empty(n_all + (extra is not None), xf.shape[1], dtype=torch.float32)
        math = self.math
        if not self.kernels.split_experts:
            if extra is not None:
                math.extra_into(extra, xf, ys[n_all:])
            for j in todo:
                batch.wait(j)
                math.into(batch, j, xf, ys[j : j + 1])
            return ys
        n_ready = 0
        while n_ready < len(todo) and batch.ready(todo[n_ready]):
            n_ready += 1
        if n_ready or extra is not None:  # all those in memory in one call, their rows over the native threads
            math.many(batch, todo[:n_ready], xf, ys, None if extra is None else (extra, n_all))
        late = todo[n_ready:]
        while late:  # the others as their reads land: the first one waited for and those landed by then
            batch.wait(late[0])
            n = 1
            while n < len(late) and batch.arrived(late[n]):
                batch.wait(late[n])  # landed: returns at once (and raises a read error, as for the first)
                n += 1
            math.many(batch, late[:n], xf, ys)
            late = late[n:]
        return ys


def moe_block(b: Build, L: int) -> MoE:
    """Layer L's MoE block."""
    return MoE(b, L)
