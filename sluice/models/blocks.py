"""Shared math of the MoE decoder family (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE): norms, attention, MoE block.

Every architecture file reduces its config to a `Spec` (the blueprint) and names its tensors; the model built here
runs the same functions for all of them. Weights are plain tensors held in dataclasses (llama2.c style), or a GGUF
file's projections kept in their stored blocks (quant/resident.py QuantLinear, run through models/linear.py); expert
weights are not held at all: the MoE block asks the `ExpertStore` for them by (layer, ids).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..matmul import bf16_gemm, sdpa
from ..quant import native
from ..quant.native import attend as native_attend
from ..quant.native import prompt
from ..quant.native.decode import DecodeAttention, router_probs_bf16
from ..quant.native.kernel import BF16_GEMM_MIN_ROWS, Q8_MAX_ROWS
from ..quant.resident import QuantLinear
from ..store.base import ExpertStore
from .experts import EXPERT_Q8_MAX_ROWS, ExpertMath, glu_for
from .linear import linear, logits
from . import mla  # latent attention; mla.py uses this module's rms_norm, so modules, not names, are imported
from .rope import apply_rope, rope_table
from .routing import route, top_of_probs
from .spec import KVCache, MLPWeights, Spec, Weights


_NATIVE = native.native_available()
# A prompt's experts with BF16_GEMM_MIN_ROWS or more rows run bf16 GEMMs on their rows padded to a multiple of this
# (zero rows, results dropped; on a CPU whose GEMM gives a row the same bits whatever the row count, as here, the
# logits are unchanged: tests/store/test_prefill.py; streamed and resident runs pad alike everywhere). oneDNN
# builds kernels for each row count it has not seen, and every prompt brings new ones. Demo model at 1 GiB, resident,
# three prompts in a fresh process, medians of 3 alternated processes (`benchmarks/prefill/knobs.py rows`): 512
# tokens 208 / 180 / 179 ms padded vs 236 / 214 / 201 unpadded; 2,048 tokens 650 / 565 / 544 vs 693 / 641 / 614.
GEMM_ROW_STEP = 16

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the reference computes it: statistics in float32, cast back, then scale. bf16 rows go through one
    native call (native.rms_norm_bf16: ~6 us against ~36 for these eight torch ops at one 1024-wide row, and a decode
    token of a 16-layer model with q/k norms runs 65 of them; the same bits but for the last bit of a row's scale)."""
    if (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and _NATIVE and x.is_contiguous()
            and weight.is_contiguous()):
        return native.rms_norm_bf16(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _mask(pos: int, T: int, window: int | None) -> torch.Tensor | None:
    """Boolean attention mask [T, pos+T] (True = attend) for queries at pos..pos+T-1; None when all may attend."""
    if T == 1 and (window is None or pos < window):
        return None
    q = torch.arange(pos, pos + T)[:, None]
    kv = torch.arange(pos + T)[None, :]
    allowed = kv <= q
    if window is not None:
        allowed &= kv > q - window
    return allowed


#: bytes of one [nH, rows, P] score block of sink_attention: query rows run in blocks this size bounds (gpt-oss-20b,
#: 64 heads, 4k positions, float32: 64 rows; at 128k positions, 2 rows); decode is one row
SINK_SCORE_BYTES = 64 * 2**20


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Causal attention whose softmax also counts one learned logit per head (gpt-oss's attention sinks).

    q [nH, T, D], k/v [nKV, P, D] (the cache up to the last query), mask [T, P] bool (True = attend) or None (all),
    sinks [nH] -> [nH, T, D]. SDPA has no sink term, so this computes what the reference's eager attention does, op
    for op: scores scaled by 1/sqrt(D), masked, the sink appended as one more column, the row max subtracted,
    softmax, the sink's column dropped, then @ v. (The same result is SDPA's output times sigmoid(lse - sink), but
    CPU SDPA does not return its log-sum-exp.) Query rows run in blocks whose scores fit SINK_SCORE_BYTES.
    """
    nH, T, D = q.shape
    group = nH // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [nH, P, D]
    v = v.repeat_interleave(group, dim=0)
    sink = sinks.to(q.dtype).view(nH, 1, 1)
    rows = max(1, SINK_SCORE_BYTES // (nH * k.shape[1] * 4))
    out = []
    for t0 in range(0, T, rows):
        qb = q[:, t0 : t0 + rows]  # [nH, t, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * D**-0.5  # [nH, t, P]
        if mask is not None:
            scores = scores.masked_fill(~mask[t0 : t0 + rows], float("-inf"))
        logits = torch.cat([scores, sink.expand(nH, scores.shape[1], 1)], dim=-1)  # [nH, t, P + 1]
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        out.append(torch.matmul(probs.to(v.dtype), v))  # [nH, t, D]
    return torch.cat(out, dim=1)


class Transformer:
    """Decoder-only MoE transformer over resident `Weights` and an `ExpertStore`.

    `forward(tokens, pos)` runs T new tokens at positions pos..pos+T-1, writing the KV cache in place, and returns
    the final-norm hidden states [T, H]; `logits(hidden)` applies the LM head.
    """

    def __init__(
        self,
        spec: Spec,
        weights: Weights,
        store: ExpertStore,
        cache: KVCache,
        dtype: torch.dtype,
        rows=None,
        prerouter=None,
        planes: int | None = None,
        prompt_prerouter=None,
    ):
        """`rows`: a RowTable serving token-embedding rows when the table is not resident (weights.embed None).
        `prerouter`: predicts the next MoE layer's experts during decode; the store prefetches them right after
        this layer's experts are pinned, so the reads overlap this layer's expert math. `planes`: the activation
        planes of the experts' integer path (LoadOptions.activations; the resident projections have theirs).
        `prompt_prerouter`: the same for prompt chunks of T * top_k >= num_experts: the next MoE layer's experts
        the chunk will likely touch are read into the slots this layer's experts leave free, while this layer's
        experts and the next layer's attention run (such a chunk touches most experts of every layer, so nearly
        every such read is used)."""
        self.spec, self.w, self.store, self.cache, self.dtype, self.rows = spec, weights, store, cache, dtype, rows
        self.prerouter, self.prompt_prerouter = prerouter, prompt_prerouter
        self._prompt_guess: tuple[int, list[int]] | None = None  # (next MoE layer, experts) for experts() to read
        # False: decode runs one expert_q8 call per expert instead of one call per layer (tests, benchmarks)
        self.split_experts = True
        # False: decode runs the torch attention and router steps where _decode_attention would run them natively
        # (tests, `benchmarks/knobs.py arms`)
        self.native_attention = True
        # False: a prompt's attention runs matmul.sdpa where attend.c would run it (tests, benchmarks)
        self.native_prompt_attention = True
        # False: each int8 prompt expert codes its own rows instead of gathering a layer's once-coded rows (tests,
        # benchmarks/prefill/knobs.py code)
        self.code_rows_once = True
        self._all_native: bool | None = None  # _native_decode's answer, computed at the first decode step
        self._qkv_groups: dict[int, object] = {}  # layer -> its q/k/v native group (or None), built at first use
        self.act = ACTIVATIONS[spec.hidden_act]
        self.expert_math = ExpertMath(dtype, self.act, glu_for(spec, self.act), planes)
        self.cos, self.sin = rope_table(spec.rope, cache.max_context, dtype)  # [P, rot] each
        self._attend: list | None | bool = False  # _decode_attention's answer, built at first use
        self._block: torch.Tensor | None = None  # experts()' [T*K, H] rows, kept across one forward's layers

    # -- attention -------------------------------------------------------------------------------------------
    def attention(self, L: int, x: torch.Tensor, pos: int, mask: torch.Tensor | None) -> torch.Tensor:
        s, lw = self.spec, self.w.layers[L]
        T, D = x.shape[0], s.head_dim
        if s.mla is not None:  # latent attention (models/mla.py) over the latent cache
            return mla.latent_attention(s.mla, s.n_heads, lw, x, self.cache.latent[L], pos, mask,
                                        self.cos[pos : pos + T], self.sin[pos : pos + T])
        q, k, v = self._qkv(L, x)  # [T, nH*D], [T, nKV*D], [T, nKV*D]
        if T == 1 and self.native_attention and (attend := self._decode_attention()) is not None:
            win = s.sliding_window[L]
            out = attend[L](q, k, v, pos, max(0, pos - win + 1) if win is not None else 0)  # [1, nH*D]
            return linear(out, lw.o, lw.o_bias)
        if s.qk_norm == "full":
            q, k = rms_norm(q, lw.q_norm, s.rms_norm_eps), rms_norm(k, lw.k_norm, s.rms_norm_eps)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        q = q.view(T, s.n_heads, D)
        k = k.view(T, s.n_kv_heads, D)
        if s.qk_norm == "head":
            q, k = rms_norm(q, lw.q_norm, s.rms_norm_eps), rms_norm(k, lw.k_norm, s.rms_norm_eps)
        cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]  # [T, rot]
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [nH, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin)  # [nKV, T, D]
        ck, cv = self.cache.k[L], self.cache.v[L]  # [nKV, P, D]
        ck[:, pos : pos + T] = k
        cv[:, pos : pos + T] = v.view(T, s.n_kv_heads, D).transpose(0, 1)
        if lw.sinks is not None:
            # a sliding layer's queries see nothing before pos - window + 1: those keys are not scored at all
            win = s.sliding_window[L]
            lo = max(0, pos - win + 1) if win is not None else 0
            part = None if mask is None else mask[:, lo:]
            out = sink_attention(q, ck[:, lo : pos + T], cv[:, lo : pos + T], part, lw.sinks)  # [nH, T, D]
        elif T > 1 and self._attend_prompt(L, pos, T):  # attend.c: causal, bf16 products, about half SDPA's time
            return linear(native_attend.causal(q, ck, cv, pos), lw.o, lw.o_bias)
        elif pos == 0 and mask is not None and (s.sliding_window[L] is None or T <= s.sliding_window[L]):
            # a prompt's first pass: the mask is the lower triangle, which SDPA's is_causal draws itself and skips
            # the blocks above the diagonal (2,048 tokens, 8 heads of 128, bf16: 52 vs 90 ms per layer, the same
            # bits; benchmarks/prefill/knobs.py sdpa); matmul.sdpa runs it on bf16 dot products with float32 sums
            out = sdpa(q[None], ck[None, :, :T], cv[None, :, :T], is_causal=True, enable_gqa=True)[0]  # [nH, T, D]
        else:  # later chunks of a prompt, decode on the torch path
            out = sdpa(q[None], ck[None, :, : pos + T], cv[None, :, : pos + T], attn_mask=mask,
                       enable_gqa=True)[0]  # [nH, T, D]
        out = out.transpose(0, 1).reshape(T, s.n_heads * D)
        return linear(out, lw.o, lw.o_bias)

    def _attend_prompt(self, L: int, pos: int, T: int) -> bool:
        """Whether layer L's attention of T > 1 queries at pos runs natively (native/attend.py): bf16 with bf16 GEMMs
        on a CPU with AVX512_BF16, heads attend.c takes, and no key outside a sliding window (the mask is then the
        causal one attend.c draws itself)."""
        s, win = self.spec, self.spec.sliding_window[L]
        return (self.native_prompt_attention and self.dtype is torch.bfloat16 and bf16_gemm()
                and native_attend.available() and not native.isa_capped()
                and native_attend.supports(s.n_heads, s.n_kv_heads, s.head_dim)
                and (win is None or pos + T <= win))

    def _decode_attention(self) -> list | None:
        """Each layer's native attention of one bf16 decode token (native/decode.py: the q / k norms, rope, cache
        writes and attention of a layer in one call instead of ~25 torch ops; moe's router probabilities go with
        it), or None where it does not apply (no extension, another dtype, latent attention, a decode step not on
        the integer path: _integer_decode) and the torch code runs. Its output matches SDPA's to within bf16
        rounding, not bitwise (decode.c says how); streamed and resident runs share it."""
        if self._attend is False:
            s, c = self.spec, self.cache
            bf16 = lambda t: t is None or (t.dtype is torch.bfloat16 and t.is_contiguous())  # noqa: E731
            ok = (_NATIVE and self.dtype is torch.bfloat16 and s.mla is None and self._integer_decode()
                  and bf16(self.cos) and c.k is not None and bf16(c.k)
                  and all(bf16(lw.router) and bf16(lw.q_norm) and bf16(lw.k_norm) for lw in self.w.layers))
            self._attend = None
            if ok:
                model = DecodeAttention(s.n_heads, s.n_kv_heads, s.head_dim, self.cos, self.sin)
                self._attend = [
                    model.layer(c.k[L], c.v[L], norm=s.qk_norm, q_norm=lw.q_norm, k_norm=lw.k_norm,
                                eps=s.rms_norm_eps, clip=s.clip_qkv,
                                sinks=None if lw.sinks is None else lw.sinks.to(self.dtype).float().contiguous())
                    for L, lw in enumerate(self.w.layers)]
        return self._attend

    def _qkv(self, L: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of layer L from x [T, H]. Kept-quantized projections at decode run as one native call (x
        quantized once, their rows over the native threads: QuantLinear.group), bitwise what three QuantLinear
        calls give; anything else goes through linear() one by one."""
        lw = self.w.layers[L]
        ws, biases = (lw.q, lw.k, lw.v), (lw.q_bias, lw.k_bias, lw.v_bias)
        group = self._qkv_groups.get(L, ())
        if group == ():
            group = self._qkv_groups[L] = (
                QuantLinear.group(list(ws)) if all(type(w) is QuantLinear for w in ws) else None)
        if group is None or x.shape[0] > Q8_MAX_ROWS:
            return tuple(linear(x, w, b) for w, b in zip(ws, biases))
        return tuple(group.linear(x, biases))

    # -- feed-forward ----------------------------------------------------------------------------------------
    def mlp(self, m: MLPWeights, x: torch.Tensor) -> torch.Tensor:
        return linear(self.act(linear(x, m.gate)) * linear(x, m.up), m.down)

    def moe(self, L: int, x: torch.Tensor) -> torch.Tensor:
        """Route x [T, H] with the true router and run the chosen experts from the store."""
        lw = self.w.layers[L]
        if (x.shape[0] == 1 and self.native_attention and self._decode_attention() is not None
                and self.spec.router == "softmax"):
            # the softmax over the router's logits in one native call (~10 us where F.linear and softmax took ~60)
            weights, ids = top_of_probs(self.spec, router_probs_bf16(x, lw.router), x.dtype)
        else:
            weights, ids = route(self.spec, lw, x)  # [T, K] each
        out = self.experts(L, x, ids, weights)
        if lw.shared is not None:
            shared = self.mlp(lw.shared, x)  # [T, H]
            out = out + (shared if lw.shared_gate is None else torch.sigmoid(linear(x, lw.shared_gate)) * shared)
        return out

    def experts(self, L: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's top-k experts, in ascending expert id (the reference's order, so bf16 sums match).

        x [T, H], ids/weights [T, K]. Expert-major: the rows routed to each expert are gathered once into one
        expert-sorted block of T*K rows (plus zero rows padding GEMMs, GEMM_ROW_STEP), each expert runs once on
        its contiguous slice (its bytes read once for the whole chunk; experts come from the store in passes of
        at most `store.max_batch`, the ones in memory first, the rest as their reads land), each output
        overwrites its own input rows, and the k partial results of a token (rows found by (token, rank of its
        expert id among the token's k)) are added in ascending id, each from zeros: bitwise what the decode path
        (and an index_add_ per expert) computes, whatever order the experts ran in.
        """
        T, K = ids.shape
        if T == 1:
            return self._experts_one_token(L, x, ids, weights, torch.zeros_like(x))
        ranked, rank_of = torch.sort(ids, dim=1, stable=True)  # [T, K]: each token's ids ascending
        flat = ranked.flatten()  # [T*K], row t*K + r = token t's r-th smallest expert id
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, tokens ascending within one
        eids, counts = torch.unique_consecutive(flat[order], return_counts=True)
        rows = torch.arange(T * K)  # sorted position -> its row of the block
        if x.dtype is torch.bfloat16 and bf16_gemm() and not self.expert_math.int8_rows(self.store.layout.format(L)):
            # each expert's rows padded to a multiple of GEMM_ROW_STEP where they go to a GEMM (see GEMM_ROW_STEP;
            # not for the int8 prompt kernels, which take any row count at one speed)
            padded = torch.where(counts >= BF16_GEMM_MIN_ROWS, (counts + GEMM_ROW_STEP - 1) // GEMM_ROW_STEP
                                 * GEMM_ROW_STEP, counts)
            rows += torch.repeat_interleave(torch.cumsum(padded - counts, 0) - (padded - counts), counts)
        else:
            padded = counts
        starts = (torch.cumsum(padded, 0) - padded).tolist()
        n_rows = int(padded.sum())
        eids, counts, padded = eids.tolist(), counts.tolist(), padded.tolist()
        # One [n_rows, H] block holds the rows all the way: the expert-sorted inputs (padding rows zero), then each
        # expert's outputs written over its own (spent) input slice, then those outputs scaled in place; the
        # ascending-rank sum gathers from it into one reused [T, H] buffer. (It held 4 such blocks: inputs, outputs,
        # rank order and y * w; at 2,048 tokens of a top-8 H=1024 bf16 model each is 32 MiB.) Its capacity covers
        # the most padding any layer may bring, so it is allocated once per prompt.
        ys = self._rows_block(n_rows, x, T * K + self.spec.num_experts * (GEMM_ROW_STEP - 1))
        coded, tok = None, order // K  # tok: each sorted row's token
        if (self.code_rows_once and n_rows == T * K and x.dtype is torch.bfloat16
                and self.expert_math.int8_whole(self.store.layout.format(L))):
            # the int8 prompt kernels code x once here, not once per expert for each of its k experts (each row's
            # codes are the same bytes either way); experts then gather their rows' codes, not their bf16 rows
            coded = prompt.code(x.contiguous())
        elif n_rows == T * K:
            torch.index_select(x, 0, tok, out=ys)
        else:  # padding rows read the zero row appended to x
            src = torch.full((n_rows,), T, dtype=torch.long).index_copy_(0, rows, order // K)
            torch.index_select(torch.cat([x, x.new_zeros(1, x.shape[1])]), 0, src, out=ys)
        step = max(1, self.store.max_batch)
        guess, self._prompt_guess = self._prompt_guess, None
        for c0 in range(0, len(eids), step):
            chunk = eids[c0 : c0 + step]
            batch = self.store.acquire(L, chunk)
            try:
                if guess is not None and len(eids) <= step:  # one pass: the other slots may take the next layer's
                    self.store.prefetch(*guess, prompt=True)
                for j in sorted(range(len(chunk)), key=lambda j: not batch.ready(j)):  # stable: ready ones first
                    batch.wait(j)
                    a, n = starts[c0 + j], padded[c0 + j]
                    if coded is None:
                        ys[a : a + n] = self._expert(batch, j, ys[a : a + n])
                    elif n > EXPERT_Q8_MAX_ROWS:
                        ys[a : a + n] = self._expert_coded(batch, j, coded, tok[a : a + n])
                    else:  # a few rows: the decode-style native call on the rows themselves
                        ys[a : a + n] = self._expert(batch, j, x[tok[a : a + n]])
            finally:
                self.store.release(L)
        w = torch.gather(weights, 1, rank_of).flatten()[order]  # [T*K] each sorted row's routing weight
        if n_rows != T * K:  # padding rows weigh nothing and are never summed
            w = torch.zeros(n_rows, dtype=w.dtype).index_copy_(0, rows, w)
        at = torch.empty_like(order).index_copy_(0, order, rows).view(T, K)  # (token, rank) -> row
        if _NATIVE and x.dtype is torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32):
            # the lines below in one call over the pool, the same bits (tests/quant/test_ops.py)
            return native.combine_rows_bf16(ys, w, at, torch.empty_like(x))
        ys.mul_(w[:, None])  # y * w rounded to x.dtype once per element, as (ys * w).to(x.dtype) and T == 1 do
        out, part = torch.zeros_like(x), torch.empty_like(x)  # [T, H] each
        for r in range(K):
            out += torch.index_select(ys, 0, at[:, r], out=part)
        return out

    def _rows_block(self, n: int, x: torch.Tensor, capacity: int = 0) -> torch.Tensor:
        """A [n, H] block of x's dtype for experts(), the same memory for every layer of a forward pass (_forward
        drops it at the end). Allocated per layer it was 32 MiB at 2,048 tokens of a top-8 H=1024 bf16 model, at or
        above glibc's largest mmap threshold: a fresh mapping each layer, 8,192 page faults to fill it (peers bf16,
        resident 2,048-token prefill: 230k -> ~90k minor faults; benchmarks/prefill/faults.py, removed: its command is
        in benchmarks/results/prefill/README.md). `capacity`: rows to allocate when it grows (room for the padding
        any layer may bring)."""
        H = x.shape[1]
        if self._block is None or self._block.dtype != x.dtype or self._block.numel() < n * H:
            self._block = None  # freed before its successor is allocated
            self._block = torch.empty(max(n, capacity) * H, dtype=x.dtype)
        return self._block[: n * H].view(n, H)

    def _expert(self, batch, j: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the j-th expert of `batch` on x [n, H] -> [n, H], straight from the slots (models/experts.py)."""
        return self.expert_math(batch, j, x)

    def _expert_coded(self, batch, j: int, coded, rows: torch.Tensor) -> torch.Tensor:
        """The j-th expert of `batch` on rows `rows` of a layer's coded x (ExpertMath.coded) -> [n, H]."""
        return self.expert_math.coded(batch, j, coded, rows)

    def _experts_one_token(
        self, L: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Decode fast path (T == 1): the same arithmetic as the grouped path (ascending ids, y * w, add into
        zeros) without the grouping ops, which cost ~0.5 ms of Python per layer (profiled on a 16-layer model).

        Experts whose bytes are in memory run first, the rest as their reads land (batch.wait), so the math of
        one overlaps the reading of the next; the outputs are summed afterwards in ascending expert id, so the
        result is bitwise the same whatever the disk's timing. Experts that run as one native call each
        (ExpertMath.one_call) go to the native code together: those already in memory in one call, the others one
        call each as they land, the rows of every call split over the native threads (_native_experts); the sum
        is the same, in the same order.
        """
        ids_l = ids[0].tolist()
        order = sorted(range(len(ids_l)), key=ids_l.__getitem__)  # top-k positions by ascending expert id
        step = max(1, self.store.max_batch)
        xf = None  # x in float32, for the one-call native experts
        for c0 in range(0, len(order), step):
            pos = order[c0 : c0 + step]
            batch = self.store.acquire(L, [ids_l[k] for k in pos])
            try:
                todo = sorted(range(len(pos)), key=lambda j: not batch.ready(j))  # stable: ready ones first
                if batch.gate_up is None and batch.packed is None and self.expert_math.one_call(batch.format, 1):
                    xf = x.float().contiguous() if xf is None else xf  # [1, H]
                    ys = self._native_experts(batch, todo, xf)  # [n, H] float32, row j = expert j
                    # as below, row by row: (y in the compute dtype) * w, rounded to out's dtype, added in id order
                    if out.dtype is torch.bfloat16 and self.dtype is torch.bfloat16 and weights.is_contiguous():
                        native.combine_bf16(ys, weights, pos, out)  # the same bits in one call
                        continue
                    ys = (ys.to(self.dtype) * weights[0, pos].unsqueeze(1)).to(out.dtype)
                    for j in range(len(pos)):
                        out += ys[j : j + 1]
                    continue
                yl: list[torch.Tensor | None] = [None] * len(pos)
                for j in todo:
                    batch.wait(j)
                    yl[j] = self._expert(batch, j, x) * weights[:, pos[j] : pos[j] + 1]  # [1, H]
                for y in yl:
                    out += y.to(out.dtype)
            finally:
                self.store.release(L)
        return out

    def _native_experts(self, batch, todo: list[int], xf: torch.Tensor) -> torch.Tensor:
        """Experts `todo` (ready ones first) of batch on xf [1, H] float32 -> [n, H] float32 (row j = expert j).
        The ones in memory run in one native call, the others as their reads land (each call takes the one waited
        for and every later one already in; only this thread waits on the store); native.set_threads' threads split
        the rows of each call (pool.c). Each row is bitwise what one expert_q8 call gives, whichever thread computed
        it. split_experts False: one expert_q8 call per expert (tests compare the two; `benchmarks/knobs.py threads`
        times the decode step either way).

        Peers Q4_K_M, resident, a token's 128 experts (benchmarks/quantized/expert_threads.py, removed: its command
        is in benchmarks/results/quantized/README.md): 16.6-18.6 ms this way on two threads, 21.7-25.5 one expert_q8
        call each on one thread, 25-29 split over a Python pool with one expert per job (the way before)."""
        ys = torch.empty(len(todo), xf.shape[1], dtype=torch.float32)
        em = self.expert_math
        if not self.split_experts:
            for j in todo:
                batch.wait(j)
                em.into(batch, j, xf, ys[j : j + 1])
            return ys
        n_ready = 0
        while n_ready < len(todo) and batch.ready(todo[n_ready]):
            n_ready += 1
        if n_ready:  # all those in memory in one call, their rows over the native threads
            em.many(batch, todo[:n_ready], xf, ys)
        late = todo[n_ready:]
        while late:  # the others as their reads land: the first one waited for and those landed by then
            batch.wait(late[0])
            n = 1
            while n < len(late) and batch.arrived(late[n]):
                batch.wait(late[n])  # landed: returns at once (and raises a read error, as for the first)
                n += 1
            em.many(batch, late[:n], xf, ys)
            late = late[n:]
        return ys

    # -- whole model -----------------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows.gather(tokens)  # [T, H], already in the compute dtype
        return self.w.embed[tokens]  # [T, H]

    def forward(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """tokens [T] at positions pos.. -> final-norm hidden states [T, H]; writes the KV cache.

        A decode step whose heavy work is all native (every projection a QuantLinear, every MoE layer's experts one
        native call; native.set_threads made a pool) runs torch on one thread: torch's OpenMP workers spin after
        each parallel op and took the core the native pool splits the experts onto (split experts beside torch on
        2 threads were no faster than unsplit ones). Peers Q4_K_M, resident, quiet, alternated replays of 48 tokens
        in one process (`benchmarks/knobs.py threads`, this on against off): 62.2 vs 74.4 ms/token, and
        47.8 vs 61.7 in a second run. The C pool's workers wait briefly between a prompt's native jobs and longer
        between a decode step's (native.pool_phase)."""
        if _NATIVE:
            native.pool_phase(prompt=tokens.shape[0] > 1)
        if tokens.shape[0] > 1:
            try:
                return self._forward(tokens, pos)
            finally:
                if _NATIVE:  # the prompt calls' kept scratch goes back (up to ~10 MB at 2,048 tokens)
                    native.release_scratch()
        if tokens.shape[0] == 1 and torch.get_num_threads() > 1 and self._native_decode():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return self._forward(tokens, pos)
            finally:
                torch.set_num_threads(threads)
        return self._forward(tokens, pos)

    def _native_decode(self) -> bool:
        """Whether a decode step runs its projections and experts natively, over native.set_threads' pool."""
        return self.split_experts and native.shared_pool() is not None and self._integer_decode()

    def _integer_decode(self) -> bool:
        """Whether a decode step's projections and experts all run natively from their quantized blocks (every
        projection a QuantLinear, every MoE layer's experts one native call): the integer kernels there already
        give a position other bits than the prefill's float kernels do, so its attention and router may run
        natively too (_decode_attention). A plain model keeps the torch steps, so its decode numerics stay what
        they were (tests/server/test_server.py's seeded repeats run on one)."""
        if self._all_native is None:
            layout = getattr(self.store, "layout", None)
            projections = [self.w.lm_head] + [getattr(lw, n) for lw in self.w.layers for n in ("q", "k", "v", "o")]
            self._all_native = (
                layout is not None and all(lw.mla is None for lw in self.w.layers)
                and all(type(w) is QuantLinear for w in projections)
                and all(self.expert_math.one_call(layout.format(L), 1) for L in layout.layers))
        return self._all_native

    def _forward(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        try:
            return self._layers(tokens, pos)
        finally:
            self._block = None  # a prompt's [T*K, H] rows are not held between passes

    def _layers(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        s = self.spec
        T = tokens.shape[0]
        if pos + T > self.cache.max_context:
            raise ValueError(f"context overflow: {pos + T} tokens > max_context {self.cache.max_context}")
        x = self.embed(tokens)
        masks: dict[int | None, torch.Tensor | None] = {}
        for L, lw in enumerate(self.w.layers):
            win = s.sliding_window[L]
            if win not in masks:
                masks[win] = _mask(pos, T, win)
            h = rms_norm(x, lw.input_norm, s.rms_norm_eps)
            x = x + self.attention(L, h, pos, masks[win])
            if self.prerouter is not None and T == 1 and (guess := self.prerouter.predict(L, x)) is not None:
                # read the next MoE layer's likely experts while this layer's run (a dense layer pins none first)
                (self.store.prefetch_next if s.moe_layers[L] else self.store.prefetch)(*guess)
            elif self.prompt_prerouter is not None and T * s.top_k >= s.num_experts and s.moe_layers[L]:
                # a prompt chunk that picks at least as many experts as a layer has (shorter ones would waste some
                # reads): read the next layer's likely ones once this layer's experts are pinned (experts())
                self._prompt_guess = self.prompt_prerouter.predict(L, x)
            h = rms_norm(x, lw.post_norm, s.rms_norm_eps)
            x = x + (self.moe(L, h) if s.moe_layers[L] else self.mlp(lw.mlp, h))
        return rms_norm(x, self.w.norm, s.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> float32 logits [T, V]."""
        return logits(hidden, self.w.lm_head)
