"""`plan(path, options) -> LoadPlan`: every decision made before a weight byte is read.

The engine (`Model.__init__`) loads what the plan says; `sluice inspect` prints the plan without loading. Both take
their decisions from here, so they cannot disagree: a budget too small for the model is the same BudgetError from
either, before any weight loads (instead of an OOM kill halfway through).

Order: index -> architecture -> spec -> resident tensors, row tables -> compute dtype -> expert layout -> resident
bytes -> KV cache bytes -> memory (auto / explicit, checked against the room this process may take) -> slots -> the
row tables' mode -> O_DIRECT -> threads -> tokenizer and end-of-generation ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .checkpoint import open as _opener
from .checkpoint.index import CONFIG, GENERATION_CONFIG, CheckpointIndex
from .checkpoint.ref import TensorRef
from .errors import ConfigError, SluiceError
from .host.cpus import usable_cpus
from .host.memory import MemoryRoom, available_memory
from .host.procstat import memory_status
from .models import gguf_archs, mlx_values, model_args
from .models.args import GenerationArgs, eos_ids
from .models.schema import parse
from .models.spec import KVCache, Spec
from .models.tables import ple_tables
from .options import LOW_BIT_BPW, LoadOptions, format_bytes
from .quant import native
from .quant.native import deltanet
from .store.budget import (PREFILL_MAX, PREFILL_MIN, PREFILL_ROOM, RUNTIME_RESERVE, STREAMED_PROMPT_TOKENS,
                           AutoPlan, BudgetPlan, PromptLoan, activation_room, auto_memory, check_room, kept_bytes,
                           lendable_bytes, plan_budget, prefill_fixed_bytes, hidden_token_bytes, prefill_pass_bytes,
                           prefill_span_tokens, prefill_token_bytes, prefill_tokens_per_chunk, prompt_loan,
                           reserve_left)
from .store.layout import ExpertLayout
from .models.weights import resident_nbytes, resident_refs
from .tokenizer import Tokenizer
from .tokenizer.gguf import tokenizer_from_gguf


@dataclass
class LoadPlan:
    """What `Model` will build, decided from the headers, the options and the room; nothing here holds weights."""

    path: Path
    options: LoadOptions
    index: CheckpointIndex
    arch: ModuleType  # the architecture module (models/<model_type>.py)
    args: Any  # its validated ModelArgs
    generation: GenerationArgs
    spec: Spec
    refs: dict[str, TensorRef]  # resident tensors, role -> where their bytes are
    layout: ExpertLayout  # where each expert's bytes are, and their stored format
    dtype: torch.dtype  # compute dtype of the resident weights, activations and KV cache
    lazy_embed: bool  # the token embedding table stays on disk (rows read per batch)
    resident_bytes: int  # resident weights as held: in `dtype`, or stored bytes when kept quantized (models/weights.py)
    max_context: int  # KV positions: options.max_context capped by the model's
    prefill_chunk: int  # prompt tokens per forward pass (options.prefill_chunk, "auto" resolved)
    prefill_span: int  # streamed: prompt tokens run layer by layer over their passes (0: pass after pass)
    prefill_why: str  # how the chunk was chosen, for inspect
    prefill_bytes: int  # a chunk's activations (fixed + per token x chunk), the span's hidden states: the heap keeps it
    kv_bytes: int
    room: MemoryRoom  # the memory this process may take, when the plan was made
    ple_tables: dict[int, list[TensorRef]]  # qwen4_exp: layer -> its n-gram table's parts (models/tables.py)
    ple: str | None  # how the tables are read: resident | mmap | direct (options.ple, "auto" resolved); None: none
    ple_bytes: int  # the tables' stored bytes (outside the budget; held only when resident)
    ple_why: str  # how `ple` was chosen, for inspect
    activations: str  # the integer kernels' activation coding (options.activations, "auto" resolved)
    activations_why: str  # how it was chosen, for inspect
    prefetch: str  # a decode token's read-ahead: none | auto | router | learned (options.prefetch, _prefetch)
    prefetch_why: str  # how it was chosen, for inspect
    memory: int | None  # budget for resident weights + expert slots; None = everything resident
    memory_plan: AutoPlan | None  # what `memory="auto"` chose (None when the budget was given)
    budget: BudgetPlan | None  # the expert slots `memory` buys (None when resident)
    odirect: bool
    threads: int  # torch threads at load
    governed: bool  # the thread count follows the CPUs other processes leave free (host/cpus.py ThreadGovernor)
    tokenizer: Tokenizer | None
    no_tokenizer: str  # why `tokenizer` is None, for the error raised when text has to be encoded
    eos_ids: set[int]
    # streamed, --prefill-chunk auto: a prompt longer than the chunk borrows expert slots for longer passes while it
    # runs (store/budget.py PromptLoan); None otherwise
    prompt_loan: PromptLoan | None = None

    def describe_memory(self) -> str:
        """The memory decision in words (stats()["memory_plan"], inspect's "--memory" line)."""
        if self.memory_plan is not None:
            return self.memory_plan.describe()
        return "everything resident" if self.memory is None else f"budget {format_bytes(self.memory)}"


def open_index(path: str | os.PathLike) -> CheckpointIndex:
    """The checkpoint index of a model folder or .gguf file (checkpoint/open.py), GGUF files and MLX folders read by
    the architectures' own facts (models.gguf_archs, models.mlx_values)."""
    return _opener.open_index(path, gguf_archs(), mlx_values())


def plan(path: str | os.PathLike, options: LoadOptions) -> LoadPlan:
    """Read the checkpoint's headers and decide everything a load needs. Raises CheckpointError / ConfigError for
    a file or option sluice cannot run, BudgetError when the memory cannot hold one step (the message says the
    smallest budget that works)."""
    path = Path(path)
    index = open_index(path)
    arch, args = model_args(index.config, index.folder / CONFIG)
    generation = parse(GenerationArgs, index.generation_config or {}, source=str(index.folder / GENERATION_CONFIG))
    spec = args.spec()
    refs = resident_refs(index, spec, arch)
    # a quantized checkpoint (GGUF Q4_K, MLX 4-bit, ...) has no dtype of its own: its dequantized weights compute in
    # bf16 unless asked otherwise (dtype=float32 is the exact reference). Any quantized resident tensor decides it:
    # a converter may leave some projections plain (MLX skips those its group size does not divide)
    o = refs["layers.0.o"]  # every attention has an output projection (latent attention has no q_proj with q_lora)
    quantized = any(r.quantized for r in refs.values())
    dtype = options.compute_dtype(torch.bfloat16 if quantized else o.torch_dtype)
    layout = ExpertLayout(index, spec, arch)
    # the prerouters read a plain residual (engine.py); auto then reads no guesses (_prefetch)
    if spec.hc_count > 1 and options.prefetch not in ("none", "auto"):
        raise ConfigError(f"prefetch {options.prefetch!r}: the next layer's experts are not predicted from "
                          f"{spec.hc_count} residual streams (hyper-connections) yet; use --prefetch none")
    lazy_embed = options.embeddings != "resident" and not spec.tie_word_embeddings
    if lazy_embed and refs["embed"].quantized:
        raise ConfigError(f"embeddings: {options.embeddings!r} reads plain rows, and this checkpoint stores the "
                          f"token embeddings as {refs['embed'].dtype}: use --embeddings resident")
    itemsize = torch.tensor([], dtype=dtype).element_size()
    resident_bytes = resident_nbytes(refs, dtype, lazy_embed)  # projections kept in their GGUF blocks at their size
    max_context = min(options.max_context, spec.rope.max_position_embeddings)
    kv_bytes = KVCache.bytes_for(spec, max_context, itemsize)
    room = available_memory()
    held = memory_status()["rss_anon_bytes"]  # already out of the room: only the rest of the reserve is to come
    tables = ple_tables(index, spec)
    table_bytes = sum(r.nbytes for parts in tables.values() for r in parts)
    # tables held by request are outside the budget: the model plans in the room they leave
    native_delta = _native_delta(dtype)
    # an explicit --prefill-chunk's passes are out of the room before auto's budget (auto's chunk takes the rest);
    # auto's own chunk, streamed: the budget leaves passes of STREAMED_PROMPT_TOKENS tokens where it can
    planned = _less(room, table_bytes if options.ple == "resident" else 0)
    if options.prefill_chunk == "auto":
        chunk_bytes, prompt_bytes = 0, prefill_pass_bytes(spec, itemsize, max_context, min(STREAMED_PROMPT_TOKENS,
                                                          max_context), max_context, native_delta)
        # a budget whose slots can lend a prompt those passes (PromptLoan) sets no room aside for them
        if options.memory == "auto":
            unreserved = _memory(options, planned, spec, layout, resident_bytes, kv_bytes, held)[0]
            if _lendable(unreserved, spec, layout, resident_bytes) >= prompt_bytes:
                prompt_bytes = 0
    else:
        chunk_bytes = prefill_pass_bytes(spec, itemsize, max_context, options.prefill_chunk, native=native_delta)
        prompt_bytes = 0
    memory, memory_plan = _memory(options, planned, spec, layout, resident_bytes, kv_bytes, held, chunk_bytes,
                                  prompt_bytes)
    budget = None
    if memory is not None:  # fewer than top_k slots: BudgetError naming the smallest budget that works
        budget = plan_budget(memory, resident_bytes, layout.expert_nbytes, spec.top_k, layout.total_experts)
    ple, ple_why = _ple(options, table_bytes, room, memory, layout, resident_bytes, kv_bytes, held)
    left = _less(room, table_bytes if ple == "resident" else 0)  # what the rest plans in
    # threads 0 (default): one per CPU this process may use (torch's own default ignores cgroup CPU quotas),
    # fewer while other processes keep CPUs busy (ThreadGovernor); an explicit count is kept as given
    odirect = _odirect(options, memory, left, layout, kv_bytes)
    chunk, span, chunk_why, acts = _prefill_chunk(options, spec, itemsize, max_context, left, memory, layout,
                                                  resident_bytes, kv_bytes, odirect, held, native_delta)
    loan = None
    if budget is not None and options.prefill_chunk == "auto" and left.known:
        loan = prompt_loan(spec, itemsize, max_context, chunk, acts, budget.slots, layout.expert_nbytes, native_delta)
    threads = options.threads or usable_cpus()
    activations, activations_why = _activations(options, layout)
    prefetch, prefetch_why = _prefetch(options, memory, spec.hc_count)
    tokenizer, no_tokenizer = _tokenizer(index, path)
    return LoadPlan(
        path=path, options=options, index=index, arch=arch, args=args, generation=generation, spec=spec, refs=refs,
        layout=layout, dtype=dtype, lazy_embed=lazy_embed, resident_bytes=resident_bytes, max_context=max_context,
        prefill_chunk=chunk, prefill_span=span, prefill_why=chunk_why, kv_bytes=kv_bytes, room=room,
        ple_tables=tables, ple=ple, ple_bytes=table_bytes, ple_why=ple_why, activations=activations,
        activations_why=activations_why, prefetch=prefetch, prefetch_why=prefetch_why, memory=memory,
        prefill_bytes=prefill_pass_bytes(spec, itemsize, max_context, chunk, span, native_delta),
        memory_plan=memory_plan, budget=budget, odirect=odirect, threads=threads,
        governed=not options.threads and threads > 1, tokenizer=tokenizer, no_tokenizer=no_tokenizer,
        eos_ids=_eos_ids(args, generation, tokenizer), prompt_loan=loan,
    )


def _memory(options: LoadOptions, room: MemoryRoom, spec: Spec, layout: ExpertLayout, resident_bytes: int,
            kv_bytes: int, held: int, chunk_bytes: int = 0,
            prompt_bytes: int = 0) -> tuple[int | None, AutoPlan | None]:
    """(budget, what auto chose): decided before any weight is loaded, so a model that cannot fit fails with a
    BudgetError instead of an OOM kill. chunk_bytes: an explicit --prefill-chunk's activations; prompt_bytes: the
    passes auto's chunk should find left when streaming (store/budget.py STREAMED_PROMPT_TOKENS)."""
    if options.memory == "auto":
        auto = auto_memory(room.bytes, room.source, resident_bytes, layout.expert_nbytes, layout.total_experts,
                           spec.top_k, kv_bytes, held, chunk_bytes, prompt_bytes)
        return auto.memory, auto
    check_room(options.memory, room.bytes, room.source, resident_bytes, layout.expert_nbytes, layout.total_experts,
               kv_bytes, held=held, top_k=spec.top_k, activations=chunk_bytes)
    return options.memory, None


def _lendable(memory: int | None, spec: Spec, layout: ExpertLayout, resident_bytes: int) -> int:
    """The slot bytes a budget of `memory` could lend a prompt (store/budget.py PromptLoan); 0 when resident."""
    if memory is None or not layout.expert_nbytes:
        return 0
    slots = plan_budget(memory, resident_bytes, layout.expert_nbytes, spec.top_k, layout.total_experts).slots
    return lendable_bytes(spec, slots, layout.expert_nbytes)


def _less(room: MemoryRoom, nbytes: int) -> MemoryRoom:
    """The room left once `nbytes` are held (an unknown room stays unknown)."""
    if not nbytes or not room.known:
        return room
    return MemoryRoom(max(0, room.bytes - nbytes), f"{room.source} less {format_bytes(nbytes)} of row tables")


def _prefetch(options: LoadOptions, memory: int | None, streams: int = 1) -> tuple[str, str]:
    """(a decode token's read-ahead of the next MoE layer's experts, why), for inspect and the engine. `auto` (the
    default) guesses with the next layer's router where the direct reader streams experts and pauses where its guesses
    are poor (store/prefetch.py AUTO_THROTTLE): `router` wins where its guesses are right (the synthetic models'
    uniform routing, 92-99%: Intel Xeon AMX, cold, 1 GiB cgroup, the issue-30 hybrid Q4_K_M 128.6 -> 103.2 ms a
    token, the peers Q4_K_M 62.2 -> 57.5) and loses where they are not (the trained demo, 68%, 55% more bytes read:
    48.3 -> 58.3 ms; `bash benchmarks/prefetch_router.sh`, benchmarks/results/prefetch-router)."""
    if memory is None:
        return "none", "everything resident"
    if options.prefetch == "none":
        return "none", "as asked"
    if options.prefetch != "auto":
        return options.prefetch, "as asked"
    if streams > 1:
        return "none", "auto: the guesses read a plain residual, not hyper-connections' streams"
    if options.io != "direct":
        return "none", f"auto: --io {options.io} reads in the thread that waits; guesses are read by --io direct"
    return "auto", ("the next layer's router guesses its experts, read while this layer computes; paused while "
                    "fewer than 80% of the guessed reads are used")


def _activations(options: LoadOptions, layout: ExpertLayout) -> tuple[str, str]:
    """(the integer kernels' activation coding, why). `auto`: int8 when the experts average under LOW_BIT_BPW stored
    bits per weight. Their own rounding then dwarfs int8's coding error: relative L2 of the weights against the
    bf16 source on the peers model (benchmarks/results/quantized/lowbit-intel/weight_error.md) Q2_K 0.30, Q3_K 0.15,
    Q4_K 0.071, IQ4_XS 0.077, against 0.005-0.008 for a projection's int8 coding (int16: 3e-5); Q5_K 0.036 and
    Q6_K 0.018 keep int16. The demo's perplexity moves <= 0.02% from int16 to int8 on every file of
    benchmarks/results/perplexity.md, and int8 decodes faster (resident, Intel Xeon AMX, peers files: Q2_K 14.8 vs
    16.3 ms, Q4_K_M 16.7 vs 18.7; benchmarks/results/quantized/lowbit-intel, intel-amx)."""
    if options.activations != "auto":
        return options.activations, "as asked"
    bpw = layout.bits_per_weight
    if bpw is None:
        return "int16", "no experts"
    if bpw < LOW_BIT_BPW:
        return "int8", f"auto: experts {bpw:.2f} bits per weight, under {LOW_BIT_BPW:g}"
    return "int16", f"auto: experts {bpw:.2f} bits per weight"


def _ple(options: LoadOptions, table_bytes: int, room: MemoryRoom, memory: int | None, layout: ExpertLayout,
         resident_bytes: int, kv_bytes: int, held: int) -> tuple[str | None, str]:
    """(how the n-gram tables are read, why); (None, "") when the model has none. `auto`: resident when they fit in
    what the room leaves beside the kept weights (the budget's), the KV cache and the runtime reserve, else read by
    rows through the direct pool (their bytes then never sit in memory: a few hundred bytes a row, scattered)."""
    if not table_bytes:
        return None, ""
    if options.ple != "auto":
        return options.ple, f"--ple {options.ple}"
    fb = format_bytes
    kept = kept_bytes(memory, resident_bytes, layout.expert_nbytes, layout.total_experts)
    left = room.bytes - kept - kv_bytes - reserve_left(held)
    beside = (f"the {fb(max(0, left))} that {fb(room.bytes)} available ({room.source}) leaves beside {fb(kept)} of "
              f"weights, the {fb(kv_bytes)} KV cache and the runtime reserve")
    if not room.known or table_bytes <= left:
        return "resident", f"auto: {fb(table_bytes)} fit in {beside}" if room.known else "auto: the room is unknown"
    return "direct", f"auto: {fb(table_bytes)} do not fit in {beside}"


def _odirect(options: LoadOptions, memory: int | None, room: MemoryRoom, layout: ExpertLayout, kv_bytes: int) -> bool:
    """options.odirect, or when None: O_DIRECT iff streaming with the direct reader and all the experts would not
    fit in the memory left beside the budget, the KV cache and the runtime (see LoadOptions.odirect)."""
    if options.odirect is not None:
        return options.odirect
    if memory is None or options.io != "direct":
        return False
    left = room.bytes - memory - kv_bytes - RUNTIME_RESERVE
    return layout.total_experts * layout.expert_nbytes > left


def _native_delta(dtype) -> bool:
    """Whether a Gated DeltaNet prompt's conv and rule will run natively (models/layers/build.py
    Build._native_delta_prompt's test, as far as the plan knows it: the extension and a dtype it computes in)."""
    return native.available() and dtype in deltanet.DTYPES


def _prefill_chunk(options: LoadOptions, spec: Spec, itemsize: int, max_context: int, room: MemoryRoom,
                   memory: int | None, layout: ExpertLayout, resident_bytes: int, kv_bytes: int,
                   odirect: bool, held: int, native_delta: bool = False) -> tuple[int, int, str, int]:
    """(prompt tokens per forward pass, the span a streamed prompt runs layer by layer, why, the activation bytes the
    chunk is sized from beside the span's hidden states). `auto`: as many as the
    activation room holds (store/budget.py activation_room: what the room leaves beside the kept weights, the KV
    cache and the runtime reserve this process does not hold yet, halved when streamed reads go through the page
    cache); PREFILL_ROOM when the room is unknown. native_delta: a Gated DeltaNet slice runs the native conv and
    rule (_native_delta).

    Streamed (a budget), a prompt longer than a chunk runs layer by layer over up to `span` tokens
    (Transformer.forward_layers): each layer's experts are read once for the span instead of once a chunk. The span's
    hidden states take at most SPAN_SHARE of the activation room (store/budget.py prefill_span_tokens), the chunk
    the rest. Measured on the peers Q4_K_M file at a 1 GiB ceiling, a 2,048-token prompt at --memory auto: 7.1 GiB
    read chunk after chunk (benchmarks/results/prefill/q4km-avx2-default-1GiB), 945 MiB layer by layer
    (benchmarks/results/quantized/intel-amx/prompt-1GiB)."""
    per_token = prefill_token_bytes(spec, itemsize, max_context)
    fb = format_bytes
    if room.known:
        kept = kept_bytes(memory, resident_bytes, layout.expert_nbytes, layout.total_experts)
        page_cache = memory is not None and not odirect
        acts = activation_room(room.bytes, kept, kv_bytes, page_cache, held)
        reserve = reserve_left(held)
        whence = (f"{'half' if page_cache else 'all'} of what {fb(room.bytes)} available ({room.source}) leaves "
                  f"beside {fb(kept)} of weights, the {fb(kv_bytes)} KV cache and {fb(reserve)} of runtime reserve "
                  f"not yet held{'; the other half is page cache for the streamed reads' if page_cache else ''}")
    else:
        acts, whence = PREFILL_ROOM, f"the room is unknown: {room.source}"
    span = prefill_span_tokens(spec, itemsize, max_context, acts) if memory is not None else 0
    hidden = span * hidden_token_bytes(spec, itemsize)
    acts = max(0, acts - hidden)
    spans = (f"; streamed: up to {span} tokens layer by layer, each layer's experts read once for them "
             f"({fb(hidden)} of hidden states)") if span else ""
    if options.prefill_chunk != "auto":
        return options.prefill_chunk, span, "--prefill-chunk" + spans, acts
    chunk = prefill_tokens_per_chunk(spec, itemsize, max_context, acts, native_delta)
    fixed = prefill_fixed_bytes(spec, itemsize, native_delta)
    fixed = f" beyond {fb(fixed)} for a Gated DeltaNet slice" if fixed else ""
    return chunk, span, (f"auto, within {PREFILL_MIN}-{PREFILL_MAX}: {fb(acts)} of activations at {fb(per_token)} "
                         f"a token{fixed}, {whence}{spans}"), acts


def _tokenizer(index: CheckpointIndex, path: Path) -> tuple[Tokenizer | None, str]:
    """tokenizer.json of a model folder, or the tokenizer a GGUF file carries in its metadata; with the reason when
    there is none.

    A GGUF whose tokenizer sluice cannot rebuild (an unknown pre-tokenizer, missing merges) still runs on token ids:
    the error is kept and raised, naming the key, when text has to be encoded."""
    metadata = getattr(index, "metadata", None)
    if metadata is None:
        if (path / "tokenizer.json").exists():
            return Tokenizer.from_folder(path), ""
        return None, f"{path} has no tokenizer.json"
    if "tokenizer.ggml.model" not in metadata:
        return None, f"{path} carries no tokenizer (tokenizer.ggml.model)"
    try:
        return tokenizer_from_gguf(metadata, str(path)), ""
    except SluiceError as e:
        return None, f"its tokenizer cannot be used: {e}"


def _eos_ids(args, generation: GenerationArgs, tok: Tokenizer | None) -> set[int]:
    """End-of-sequence ids: generation_config.json's and config.json's (both validated), and the tokenizer's."""
    ids = eos_ids(generation.eos_token_id, args.eos_token_id)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    ids.update(getattr(tok, "eog_token_ids", ()))  # a GGUF vocabulary's end-of-generation tokens (llama.cpp's)
    return ids
