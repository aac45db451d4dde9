"""How a memory budget splits into resident weights and expert slots (DESIGN: the store owns the budget)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..errors import BudgetError, MemoryWarning
from ..units import format_bytes


@dataclass(frozen=True)
class BudgetPlan:
    """memory = resident + slots * expert_bytes (+ slack). The KV cache is accounted separately."""

    memory: int
    resident_bytes: int
    expert_bytes: int  # one expert of one layer, all projections
    slots: int
    total_experts: int  # experts over all MoE layers

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def cached_fraction(self) -> float:
        return min(1.0, self.slots / self.total_experts) if self.total_experts else 1.0


def plan_budget(memory: int, resident_bytes: int, expert_bytes: int, top_k: int, total_experts: int) -> BudgetPlan:
    """Slots = (memory - resident) // expert_bytes, capped at the number of experts.

    Raises BudgetError when fewer than `top_k` slots remain (one token of one layer could not run), stating the
    smallest budget that works.
    """
    slots = max(0, (memory - resident_bytes) // expert_bytes) if expert_bytes else 0
    if slots < top_k:
        need = resident_bytes + top_k * expert_bytes
        raise BudgetError(
            f"--memory {format_bytes(memory)} is too small: resident weights take {format_bytes(resident_bytes)} "
            f"and one layer needs {top_k} expert slots of {format_bytes(expert_bytes)}; "
            f"the smallest budget that works is {format_bytes(need)} ({need} bytes)"
        )
    return BudgetPlan(memory, resident_bytes, expert_bytes, min(slots, total_experts), total_experts)


# What a streaming run holds beyond its budget and the KV cache: torch's runtime, activations, I/O staging. The
# benchmarks measure peak RSS 225-250 MiB above --memory (benchmarks/results/peers, standard); a fraction of the
# room on top covers allocator slack on big machines.
RUNTIME_RESERVE = 256 * 2**20


def reserve_left(held: int) -> int:
    """The part of RUNTIME_RESERVE still to come for a process that already holds `held` bytes of anonymous memory
    (torch and Python take ~170 MiB by the time a plan is made): the room (a cgroup's limit minus its usage, or
    MemAvailable) is already net of what is held."""
    return max(0, RUNTIME_RESERVE - held)


# Prefill activations of a chunk of T prompt tokens, per token and layer at their peak, the MoE block: the residual,
# its norm, the expert-sorted [T*K, H] block (models/layers/moe.py Experts), the [T, H] sum and its gather
# buffer, one expert's [n, 4I + H] intermediates (n <= T), the router's [T, E] scores, the int64 row indices, and the
# [T, context] bool attention mask. Attention adds no T x context scores: torch's CPU SDPA is a flash kernel
# (measured: a 4096-token causal pass grew peak RSS by 39 MiB where the scores would be 1 GiB). Peak RSS grows about
# twice those live bytes: glibc keeps freed activations in its heap and per-thread arenas. Measured
# (`benchmarks/prefill/knobs.py activation`, peers Q4_K_M resident, one chunk): +24.5 MiB at 512 tokens, +137.4 MiB at
# 2,048, a slope of 75 KiB a token; the estimate below says 72 KiB (the code before the one-block MoE: 115 KiB).
ALLOCATOR_FACTOR = 2
PREFILL_ROOM = 64 * 2**20  # activation bytes a chunk may take when the room is unknown
#: a streamed prefill's layer-by-layer span keeps its tokens' hidden states in at most this share of the activation
#: room, or of the smallest chunk's activations where the room holds less (the peers model: 2 KiB a token against
#: the 75.8 KiB a chunk's token costs; at a 1 GiB ceiling --memory auto left the floor's 256 tokens, 19 MiB, and
#: a quarter of that held 2,424 tokens' hidden states, before STREAMED_PROMPT_TOKENS: `sluice inspect model-Q4_K_M.gguf`
#: in a 1 GiB memory cgroup)
SPAN_SHARE = 1 / 4
PREFILL_MIN, PREFILL_MAX = 256, 4096  # 256: the old fixed chunk; 4096: its mask stays <= 16 MiB per 4K context
#: `--memory auto`, streamed, `--prefill-chunk auto`: the budget leaves a prompt room for passes of this many tokens
#: (and its span's hidden states) where it can, so the passes are not the floor's 256: each pass runs every touched
#: expert again on a few rows (on AMX, oneDNN packs each freshly dequantized expert per call). Measured on the peers
#: Q4_K_M file at a 1 GiB ceiling, Intel Xeon AMX, 3 rounds (`OUT=benchmarks/results/quantized/intel-amx-2
#: SETS=chunks bash benchmarks/quantized/run.sh` at 046bbfb, chunks-1GiB/): the 2,048-token prompt in 256-token
#: passes 232.6 tok/s and decode after it 51.9 ms a token; 1024-token passes (76 MiB out of the 704 MiB budget)
#: 536.7 tok/s and 54.9 ms; 2048-token passes 752.4 and 70.4. Where the room is larger the passes cost a smaller share
#: of it (~120 MiB of a 14 GiB budget for a Qwen3.6-35B-A3B at 16 GiB). Where the budget's slots can lend the passes
#: (PromptLoan below) nothing is set aside: the prompt borrows them while it runs.
STREAMED_PROMPT_TOKENS = 1024


#: MoE layers' worth of experts a prompt that borrows slots (PromptLoan) leaves the store: the layer running (its
#: experts stay pinned or cached between its passes) and the next one, which the prompt's read-ahead fills meanwhile
LEND_KEEP_LAYERS = 2


@dataclass(frozen=True)
class PromptLoan:
    """A streamed prompt longer than the plan's chunk borrows expert slots for its passes while it runs: a long prompt
    runs every layer's experts on its rows (the slots churn through all of them anyway), and passes as long as the
    prompt run each expert once on all its rows instead of once a pass (on AMX oneDNN packs each freshly dequantized
    expert per call). The store gives up to `lendable` bytes of slots back to the kernel (StreamingExpertStore.lend),
    the passes grow into them, and the slots come back, empty, once the prompt's activations are freed.

    `room`: the activation bytes the plan's chunk is sized from (beside the span's hidden states); `fixed` and
    `per_token`: a pass's estimate (prefill_fixed_bytes, prefill_token_bytes); `widest`: the most tokens a pass may
    take (PREFILL_MAX, max_context); `keep`: the slots the store keeps (LEND_KEEP_LAYERS layers' experts)."""

    chunk: int
    room: int
    fixed: int
    per_token: int
    widest: int
    keep: int
    lendable: int

    def borrow(self, tokens: int) -> int:
        """Slot bytes a prompt of `tokens` tokens borrows: what one pass of them (at most `widest`) needs beyond the
        room, at most what the store can lend; 0 when the plan's chunk already takes them all."""
        if tokens <= self.chunk:
            return 0
        want = self.fixed + min(tokens, self.widest) * self.per_token - self.room
        return max(0, min(want, self.lendable))

    def _holds(self, lent: int) -> int:
        """Tokens one pass's estimate fits in the room and `lent` borrowed bytes."""
        return (self.room + lent - self.fixed) // self.per_token if self.per_token else self.widest

    def widest_pass(self) -> int:
        """The most tokens one pass may take with every lendable byte borrowed (inspect prints it)."""
        return max(self.chunk, min(self.widest, self._holds(self.lendable)))

    def chunk_for(self, tokens: int, lent: int) -> int:
        """Tokens per pass for a prompt of `tokens` tokens with `lent` slot bytes borrowed (never below the plan's): all
        of them, or as few passes as the memory holds, of equal length (2,048 tokens in 1,959-token passes would run
        a pass of 89)."""
        wide = min(tokens, self.widest, self._holds(lent))
        if wide <= self.chunk:
            return self.chunk
        n = -(-tokens // wide)
        return max(self.chunk, -(-tokens // n))


def prompt_loan(spec, itemsize: int, max_context: int, chunk: int, room: int, slots: int, expert_bytes: int,
                native: bool = False) -> PromptLoan | None:
    """The PromptLoan of a streamed plan whose passes take `chunk` tokens sized from `room` activation bytes, its
    budget holding `slots` slots of `expert_bytes`; None when the store would keep every slot (a budget of fewer than
    LEND_KEEP_LAYERS layers' experts: the prompt's layers already churn them) or the chunk is the widest already."""
    widest = min(PREFILL_MAX, max_context)
    lendable = lendable_bytes(spec, slots, expert_bytes)
    if not lendable or chunk >= widest:
        return None
    return PromptLoan(chunk, room, prefill_fixed_bytes(spec, itemsize, native),
                      prefill_token_bytes(spec, itemsize, max_context), widest, LEND_KEEP_LAYERS * spec.num_experts,
                      lendable)


def lendable_bytes(spec, slots: int, expert_bytes: int) -> int:
    """The bytes of `slots` expert slots a prompt may borrow: all but LEND_KEEP_LAYERS layers' experts."""
    return max(0, slots - LEND_KEEP_LAYERS * spec.num_experts) * expert_bytes


def prefill_token_bytes(spec, itemsize: int, max_context: int) -> int:
    """Peak RSS one prompt token of a prefill chunk costs (see ALLOCATOR_FACTOR for the measurement)."""
    H, K = spec.hidden_size, spec.top_k
    I = max(spec.moe_intermediate_size, spec.shared_expert_intermediate_size,
            0 if all(spec.moe_layers) else spec.dense_intermediate_size)
    qkv = ((2 if spec.attn_gate else 1) * spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim  # gate: 2x q_proj
    if spec.mla is not None:  # q, its latent-space copy (absorbed form), the attended output, the latent + rope key
        m = spec.mla
        qkv = spec.n_heads * (m.qk_head_dim + m.kv_lora_rank + m.v_head_dim) + m.cache_dim
    if spec.delta is not None:  # a Gated DeltaNet layer's projections over the whole pass (q | k | v, z, b, a)
        d = spec.delta  # and its gated output; its rule's blocks: prefill_fixed_bytes (bounded by its slice)
        qkv = max(qkv, d.conv_dim + 2 * d.value_dim + 2 * d.n_v_heads)
    mixer = itemsize * qkv
    live = itemsize * (H * (K + 5) + 4 * I) + mixer + 8 * spec.num_experts + 6 * 8 * K + max_context
    # qwen4_exp (counted from its tensors): the hc_count streams and the injected output that replaces them (a
    # prompt's norm, mix weights and products live one HC_SLICE of rows at a time, models/layers/hyper.py); a PLE
    # pass's rows (staged, gathered, converted) and its gated values, normed and convolved; QSA's masks beside the
    # causal one (chosen blocks, tail, causal, their union). Measured on benchmarks/ple's model (hidden 2048, 4
    # streams, bf16; `benchmarks/prefill/knobs.py activation --model M --prompts 512`, then 2048): +114.1 / +388.8
    # MiB, a slope of 183 KiB a token, where this estimate says 341 (405 when it counted 4 streams' worth)
    if spec.hc_count > 1:
        live += itemsize * 2 * spec.hc_count * H
    if spec.ple is not None:
        live += 3 * itemsize * spec.ple.embed_dim + itemsize * 3 * spec.hc_count * H
    if spec.qsa is not None:
        live += 4 * max_context
    return ALLOCATOR_FACTOR * live


def prefill_fixed_bytes(spec, itemsize: int, native: bool = False) -> int:
    """Peak RSS a prefill pass's activations take whatever its length: a Gated DeltaNet layer runs a long pass in
    slices of a fixed number of tokens (models/spec.py DELTA_SLICE), its steps' live bytes held for one slice at a
    time (DeltaNetSpec.prompt_bytes_per_token: the torch steps' float32 blocks, ~232 KiB a token at Qwen3.5's shapes,
    or with `native` the native conv and rule's outputs, ~88; measured 207-296 / 79-104: delta_prompt_memory.txt)."""
    return 0 if spec.delta is None else ALLOCATOR_FACTOR * spec.delta.prompt_slice_bytes(itemsize, native)


def hidden_token_bytes(spec, itemsize: int) -> int:
    """What one prompt token's hidden state takes between layers (the residual streams' under hyper-connections)."""
    return itemsize * spec.hidden_size * max(1, spec.hc_count)


def prefill_span_tokens(spec, itemsize: int, max_context: int, room: int) -> int:
    """Prompt tokens a streamed prefill runs layer by layer (Transformer.forward_layers): their hidden states stay
    between layers, so they take at most SPAN_SHARE of the activation room (of a PREFILL_MIN chunk's activations
    where the room is smaller: the chunk never gets fewer tokens); at most max_context."""
    room = max(room, PREFILL_MIN * prefill_token_bytes(spec, itemsize, max_context))
    return min(max_context, int(room * SPAN_SHARE) // hidden_token_bytes(spec, itemsize))


def prefill_pass_bytes(spec, itemsize: int, max_context: int, chunk: int, span: int = 0, native: bool = False) -> int:
    """What a prompt's passes of `chunk` tokens take (prefill_fixed_bytes, then prefill_token_bytes a token), with the
    hidden states of a layer-by-layer span of `span` tokens."""
    return (prefill_fixed_bytes(spec, itemsize, native) + chunk * prefill_token_bytes(spec, itemsize, max_context)
            + span * hidden_token_bytes(spec, itemsize))


def prefill_tokens_per_chunk(spec, itemsize: int, max_context: int, room: int = PREFILL_ROOM,
                             native: bool = False) -> int:
    """Prompt tokens per forward pass: as many as `room` bytes of activations hold (prefill_fixed_bytes, then
    prefill_token_bytes a token), within [PREFILL_MIN, PREFILL_MAX]. Larger chunks read each touched expert once for
    more tokens (a streamed layer reads its experts once per chunk)."""
    per_token = prefill_token_bytes(spec, itemsize, max_context)
    return max(PREFILL_MIN, min(PREFILL_MAX, (room - prefill_fixed_bytes(spec, itemsize, native)) // per_token))


def kept_bytes(memory: int | None, resident_bytes: int, expert_bytes: int, total_experts: int) -> int:
    """Weights a plan allocates for sure: every weight for `all` (memory None), else the resident weights and the
    expert slots the budget buys."""
    if memory is None:
        return resident_bytes + total_experts * expert_bytes
    slots = min(total_experts, max(0, (memory - resident_bytes) // expert_bytes)) if expert_bytes else 0
    return resident_bytes + slots * expert_bytes


def activation_room(room: int, kept: int, kv_bytes: int, page_cache: bool, held: int = 0) -> int:
    """Bytes a prefill chunk's activations may take: what `room` (the memory this process may still take) leaves
    beside the kept weights (kept_bytes), the KV cache and the part of RUNTIME_RESERVE the runtime does not hold yet
    (reserve_left(held), `held`: this process's anonymous memory now); half of it when the streamed expert reads go through the page cache (mmap, willneed,
    direct without O_DIRECT), so the pages read for the chunk are not evicted by its own activations before the
    math uses them. A resident run or O_DIRECT reads keep no expert bytes in the page cache: all of it."""
    left = max(0, room - kept - kv_bytes - reserve_left(held))
    return left // 2 if page_cache else left


@dataclass(frozen=True)
class AutoPlan:
    """What `--memory auto` chose: memory None = everything resident, else the streaming budget; the footprint it
    planned beside the weights: the KV cache, and `reserve` more for the runtime beside the `held` bytes the process
    already held (torch, Python: out of the room already)."""

    memory: int | None
    room: int
    source: str
    reserve: int
    kv_bytes: int = 0
    held: int = 0
    activations: int = 0  # an explicit --prefill-chunk's passes (auto's chunk takes what the budget leaves)
    prompt: int = 0  # left for auto's chunk: STREAMED_PROMPT_TOKENS tokens' passes, where the room holds them

    def describe(self) -> str:
        where = f"{format_bytes(self.room)} available ({self.source})"
        acts = f", {format_bytes(self.activations)} for --prefill-chunk's passes" if self.activations else ""
        acts += f", {format_bytes(self.prompt)} for a prompt's passes" if self.prompt else ""
        beside = (f"beside a KV cache of {format_bytes(self.kv_bytes)}{acts} and {format_bytes(self.reserve)} more for "
                  f"the runtime ({format_bytes(self.held)} already held)")
        if self.memory is None:
            return f"auto: everything resident, it fits in {where} {beside}"
        return f"auto: streaming experts with a {format_bytes(self.memory)} budget, of {where} {beside}"


def auto_memory(room: int, source: str, resident_bytes: int, expert_bytes: int, total_experts: int, top_k: int,
                kv_bytes: int, held: int = 0, activations: int = 0, prompt: int = 0) -> AutoPlan:
    """`--memory auto`: resident when the whole model, the KV cache and a runtime reserve fit in `room` (the bytes
    this process may still take, see sysmem.available_memory); else stream with the rest of the room as budget.

    The reserve is the part of RUNTIME_RESERVE the process does not hold yet (reserve_left(held): `held`, its
    anonymous memory now, is out of the room already), at least 1/20 of the room (allocator slack on big machines).
    It was RUNTIME_RESERVE on top of what was held: ~170 MiB of torch and Python counted twice, which at a 1.5 GiB
    ceiling left a 1.05 GB file streamed (13 MB read a token) where it fits (issue 33).

    `activations`: what an explicit --prefill-chunk's passes take (the plan's estimate: prefill_fixed_bytes + chunk x
    prefill_token_bytes), out of the room before the budget. Auto's own chunk is sized from what the budget leaves;
    an explicit one was not counted, and `--prefill-chunk 1024` at a 1 GiB ceiling was OOM-killed in every round
    (the peers Q4_K_M, 2026-12-03). `prompt`: what auto's own chunk should find left when streaming (passes of
    STREAMED_PROMPT_TOKENS tokens): taken from the budget where the budget still holds one layer's top_k experts
    beside it, else not (the passes then take the floor's PREFILL_MIN tokens, as before).

    Raises BudgetError naming the room, where it comes from and the smallest room that works when not even the
    resident weights plus one layer's top_k experts fit.
    """
    reserve = max(reserve_left(held), room // 20)
    usable = room - kv_bytes - reserve - activations
    if resident_bytes + expert_bytes * total_experts <= usable:
        return AutoPlan(None, room, source, reserve, kv_bytes, held, activations)
    need = resident_bytes + top_k * expert_bytes
    if usable < need:
        raise BudgetError(
            f"not enough memory for this model: {format_bytes(room)} available ({source}), and it needs at least "
            f"{format_bytes(need + kv_bytes + reserve + activations)}: resident weights {format_bytes(resident_bytes)}"
            f" + {top_k} expert slots of {format_bytes(expert_bytes)} + KV cache {format_bytes(kv_bytes)} (lower it "
            f"with --max-context)"
            + (f" + {format_bytes(activations)} for --prefill-chunk's passes (lower it)" if activations else "")
            + f" + {format_bytes(reserve)} for the runtime. Free memory, lower --max-context, or pass --memory SIZE "
            "to choose the budget yourself"
        )
    if usable - prompt < need:
        prompt = 0
    return AutoPlan(usable - prompt, room, source, reserve, kv_bytes, held, activations, prompt)


def check_room(memory: int | None, room: int, source: str, resident_bytes: int, expert_bytes: int,
               total_experts: int, kv_bytes: int, held: int = 0, top_k: int = 1, activations: int = 0) -> None:
    """An explicit budget (or `all`, memory None) against the room this process may take (sysmem).

    `auto` sizes itself from the room; a budget the user chose does not. What the plan allocates for sure is the
    weights it keeps (everything for `all`; resident + the slots the budget buys when streaming) and the KV cache;
    the runtime takes about RUNTIME_RESERVE more. Under a cgroup limit, a budget that does not fit beside both is a
    BudgetError before any weight loads, naming the largest budget that fits: above the limit the kernel kills the
    process, and just under it the page cache the streamed experts need is squeezed out, so every step re-reads
    them (measured: `--memory 300MiB` in a 512 MiB cgroup, 360 MiB available, re-read 16 GB in 50 s and had not
    made 48 tokens in 240 s). Above MemAvailable it is a MemoryWarning: others may free memory, or swap; the user
    decides. `held`: this process's anonymous memory now, so only reserve_left(held) is still needed (as
    activation_room counts it): at a 1 GiB ceiling the peers benchmark's `--memory 640MiB` had a peak RSS of 918 MiB.
    `activations`: an explicit --prefill-chunk's passes (auto_memory's), counted with the KV cache.
    """
    weights = kept_bytes(memory, resident_bytes, expert_bytes, total_experts)
    what = "--memory all (every weight resident)" if memory is None else f"--memory {format_bytes(memory)}"
    need = weights + kv_bytes + activations
    reserve = reserve_left(held)
    if need + reserve <= room:
        return
    acts = f", {format_bytes(activations)} for --prefill-chunk's passes" if activations else ""
    detail = (f"{what} keeps {format_bytes(weights)} of weights, plus a KV cache of {format_bytes(kv_bytes)} "
              f"(--max-context){acts} and about {format_bytes(reserve)} more for the runtime, but only "
              f"{format_bytes(room)} is available ({source})")
    chunk = ", a smaller --prefill-chunk (or auto: a streamed prompt borrows expert slots)" if activations else ""
    advice = ("pass --memory auto (streams experts within the room) or a smaller --memory SIZE, or lower "
              f"--max-context{chunk}")
    if not source.startswith("cgroup"):
        warnings.warn(f"{detail}; it may run out of memory. If it does, {advice}", MemoryWarning, stacklevel=2)
        return
    why = "the process would be killed by the kernel" if need > room else \
        "it would be left too little memory and thrash (the streamed experts re-read from disk at every step)"
    largest, smallest = room - kv_bytes - activations - reserve, resident_bytes + top_k * expert_bytes
    if largest >= smallest:
        mib = largest // 2**20  # shown in whole MiB, rounded down so that it fits, unless that is too small
        shown = f"{mib}MiB" if mib * 2**20 >= smallest else str(largest)
        raise BudgetError(f"{detail}: {why}. The largest budget that fits is --memory {shown}; or pass "
                          f"--memory auto (streams experts within the room), or lower --max-context{chunk}")
    raise BudgetError(f"{detail}: {why}, and no budget fits: the smallest that runs, {format_bytes(smallest)} "
                      f"(resident weights + {top_k} expert slots), needs "
                      f"{format_bytes(smallest + kv_bytes + activations + reserve)} "
                      "with the KV cache and the runtime. Lower --max-context (--memory auto then finds the budget)"
                      f"{chunk}, free memory, or raise the limit")
