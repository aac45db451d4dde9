"""`sluice.load(path, ...)` -> Model: the public Python API (DESIGN.md "Public contracts").

Wires the components that `plan()` (plan.py) decided: CheckpointIndex (where bytes are) -> reader (how bytes move)
-> ExpertStore (what stays in memory) -> Transformer (math) -> generate loop (generate.py), tokenizer and sampler.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .errors import RequestError
from .generate import PromptMemo, StepTimes, Teacher, TextStream, generate_step, passes
from .host import omp
from .host.cpus import ThreadGovernor, amx_bf16
from .host.memory import keep_heap, trim_heap
from .host.procstat import counters, memory_status
from .io import DEFAULT_WORKERS, ROW_WORKERS, make_reader
from .io.engines import URING_DEPTH, resolve_engine
from .models.layers import Build
from .models.model import Transformer
from .models.spec import KVCache
from .models.tables import check_hashes
from .options import ACTIVATION_PLANES, LoadOptions
from .plan import LoadPlan, plan
from .prompts import Prompts
from .quant import native
from .quant.compute import Compute
from .quant.matmul import resolve_matmul
from .quant.native import pool
from .prerouter.predict import PREROUTER_FILE, LearnedPrerouter, RouterPrerouter, model_fingerprint
from .sampling import LogitsProcessor, Sampler, make_logits_processors, make_sampler
from .store.resident import ResidentExpertStore
from .store.rows import RowTable
from .models.weights import load_resident
from .tokenizer import Tokenizer


class Model:
    """A loaded model. `logits(ids)`, `generate(prompt, ...)`, `stats()`; `last_tokens` holds the last output ids and
    `step_times` the last generation's (or replay's) prefill and per-step wall times."""

    def __init__(self, path: str | os.PathLike, options: LoadOptions, progress: bool = False,
                 load_plan: LoadPlan | None = None):
        """Load what `load_plan` (default: `plan(path, options)`) decided."""
        omp.warn_torch_first()  # once: torch came first and its OpenMP threads spin (host/omp.py)
        t0 = time.perf_counter()
        p = load_plan if load_plan is not None else plan(path, options)
        self.load_plan = p  # every decision made before the weights loaded (plan.py)
        self.path, self.options, self.index, self.arch, self.args = p.path, p.options, p.index, p.arch, p.args
        self.spec, self.layout, self.dtype, self.resident_bytes = p.spec, p.layout, p.dtype, p.resident_bytes
        self.memory, self.memory_plan, self.odirect = p.memory, p.memory_plan, p.odirect
        self.prefill_chunk = p.prefill_chunk
        self.prefill_span = p.prefill_span  # streamed: prompt tokens run layer by layer over their chunks
        self.prompt_loan = p.prompt_loan  # streamed: a long prompt's passes in borrowed slots (store/budget.py)
        self.tokenizer, self.eos_ids = p.tokenizer, p.eos_ids
        self.prompts = Prompts.of_plan(p)  # prompt -> checked ids (prompts.py)
        s = self.spec
        # every kernel choice the options and this CPU decide, held by this model alone (quant/compute.py)
        self.compute = Compute(dtype=self.dtype, bf16_gemm=resolve_matmul(p.options.matmul, p.options.isa != "auto"),
                               planes=ACTIVATION_PLANES[p.activations], path=native.PATHS[p.options.isa],
                               threads=p.threads, amx=p.options.isa == "auto" and amx_bf16())
        self._threads = p.threads  # what this model runs on (the governor may lower it beside a busy process)
        # how long the C pool's workers wait for the next job: shorter where experts stream (native/pool.py)
        self._pool_wait = pool.WAIT_RESIDENT_NS if p.memory is None else pool.WAIT_STREAMED_NS
        self._apply_threads()
        keep_heap(p.prefill_bytes)  # process-wide: a prefill's blocks stay in the heap (host/memory.py)
        self.governor = ThreadGovernor(p.threads, set_threads=self._set_threads) if p.governed else None
        self.cache = KVCache(s, p.max_context, self.dtype)  # torch.empty: costs nothing until positions are written
        # the expert reader: the io_uring where allowed, URING_DEPTH reads in flight there (io/direct.py says why)
        engine = resolve_engine(p.options.io_engine) if p.options.io == "direct" else p.options.io_engine
        workers = p.options.io_workers or (URING_DEPTH if engine == "uring" else DEFAULT_WORKERS)
        self.reader = make_reader(p.options.io, workers=workers, odirect=self.odirect, engine=engine)
        # read each weight file only as the version whose header was read: a shard replaced, truncated or rewritten
        # while the model runs is a CheckpointError naming it (io/base.py FileGuard), not a SIGBUS or wrong bytes
        self.reader.expect(self.index.stamps())
        self._own_readers: list = []  # readers made for the row tables (close() closes them)
        self._row_reader = None  # the n-gram tables' own reader, when their rows are streamed (_make_table)
        weights = load_resident(p.refs, s, self.compute, lazy_embed=p.lazy_embed)
        self.rows = self._make_rows(p.refs["embed"]) if p.lazy_embed else None
        check_hashes(self.index, s)
        self.tables = {L: self._make_table(L, parts) for L, parts in p.ple_tables.items()}  # qwen4_exp: n-gram rows
        self.store = self._make_store(progress)
        prerouter = None
        # TODO: the prerouters read a plain residual; under hyper-connections (hc_count > 1) the next MoE layer's
        # input is a mix of the streams (models/layers/hyper.py), which they do not compute yet: no read-ahead
        # (plan.py refuses --prefetch there)
        streams = s.hc_count > 1
        if p.prefetch in ("router", "auto") and self.memory is not None and not streams:
            prerouter = RouterPrerouter(s, weights, margin=p.options.prefetch_margin, path=self.compute.path,
                                        bf16=self.compute.bf16_gemm)
        elif p.prefetch == "learned" and self.memory is not None and not streams:
            fingerprint = model_fingerprint(s, self.index.config, p.refs)
            prerouter = LearnedPrerouter.load(self.path / PREROUTER_FILE, s, fingerprint, p.options.prefetch_margin)
        # not on the mmap reader: its submit copies in the caller, so the read-ahead would stall this layer's math
        prompt_prerouter = (RouterPrerouter(s, weights, bf16=self.compute.bf16_gemm)
                            if p.options.prompt_prefetch and self.memory is not None and self.reader.mode != "mmap"
                            and not streams else None)
        build = Build(s, weights, self.store, self.cache, self.compute, rows=self.rows, prerouter=prerouter,
                      prompt_prerouter=prompt_prerouter, tables=self.tables)
        self.model = Transformer(self.arch, build)
        self.load_s = time.perf_counter() - t0
        self.last_tokens: list[int] = []
        self.step_times = StepTimes()
        self._loaned = (0, 0)  # the last prompt's passes in borrowed slots: (tokens a pass, bytes lent); (0, 0) none
        self._kv_tokens: list[int] = []  # tokens the cache holds (keys / values, recurrent state), in order
        self._memo = PromptMemo()  # the last prefilled prompt's last hidden state (a repeated request starts there)
        self._gen_faults = (0, 0, 0)
        self._prefill_io: tuple | None = None  # (bytes read, disk bytes, expert reads per layer) of the last prefill

    def _need_tokenizer(self, what: str) -> Tokenizer:
        return self.prompts.need_tokenizer(what)

    def _set_threads(self, n: int) -> None:
        """The governor's choice, for torch's threads and the native ones (beside a busy process a second thread
        waits a scheduler slice at every layer)."""
        self._threads = n
        self._apply_threads()

    def _apply_threads(self) -> None:
        """Run on this model's threads: torch's and the C pool's (native/pool.py) are the process's, shared by
        every model in it, so each model applies its own when it starts work (load, logits, each generation).
        Decode splits the rows of a layer's native experts and of the quantized projections over them: peers
        model's Q4_K_M file, resident, the 128 experts of one token, 2-CPU VM (benchmarks/quantized/
        expert_threads.py, 4 alternated rounds): 21.7-25.5 ms one expert_q8 call each on one thread, 16.6-18.6 ms
        as one call per layer over two threads (a Python pool with one expert per job took 25-29 ms)."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        if pool.threads() != self._threads:
            pool.set_threads(self._threads)
        pool.set_wait(self._pool_wait)  # the pool's wait between jobs, this model's too (native/pool.py set_wait)

    def _tick(self) -> None:
        """Between forward passes: match the thread count to the CPUs other processes leave free."""
        if self.governor is not None:
            self.governor.tick()

    def _make_rows(self, ref) -> RowTable:
        mode = self.options.embeddings
        # share the reader when it is of the kind the table needs; otherwise the table makes its own
        same = (mode == "direct") == (self.options.io == "direct")
        return RowTable(ref, mode, reader=self.reader if same else None, dtype=self.dtype)

    def _make_table(self, L: int, parts) -> RowTable:
        """Layer L's n-gram table in the plan's mode (resident, or rows read per pass), one logical table over its
        parts. Streamed rows go through the tables' own reader (one for every table, made here once): the direct pool
        of ROW_WORKERS reads in flight (--io-workers sets both pools), so a pass's rows never queue behind expert
        reads; mmap rows through the model's mapping when it has one."""
        mode = self.load_plan.ple
        if mode == "resident" or mode == "mmap" and self.options.io == "mmap":
            reader = self.reader
        else:
            if self._row_reader is None:
                workers = self.options.io_workers or (ROW_WORKERS if mode == "direct" else DEFAULT_WORKERS)
                self._row_reader = make_reader(mode, workers=workers, odirect=self.odirect,
                                               engine=resolve_engine(self.options.io_engine, uring=False))
                self._row_reader.expect(self.index.stamps())
                self._own_readers.append(self._row_reader)
            reader = self._row_reader
        name = self.spec.ple.table.format(layer=L)
        return RowTable(parts, mode, reader=None if mode == "resident" else reader, dtype=self.dtype, name=name)

    def _make_store(self, progress: bool):
        if self.memory is None:
            return ResidentExpertStore(self.layout, self.reader, self.dtype, progress=progress,
                                       bf16_gemm=self.compute.bf16_gemm)
        from .store.prefetch import AUTO_THROTTLE, ROUTER_THROTTLE
        from .store.streaming import StreamingExpertStore

        throttle = AUTO_THROTTLE if self.load_plan.prefetch == "auto" else ROUTER_THROTTLE
        return StreamingExpertStore.with_budget(self.layout, self.reader, self.memory - self.resident_bytes,
                                                self.memory, overlap=self.options.overlap, throttle=throttle)

    # -- logits --------------------------------------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Full-sequence prefill logits [T, vocab] in float32, from an empty cache."""
        ids = self._check_ids(ids)
        self.forget_cache()
        out = []
        self._apply_threads()
        with torch.inference_mode():  # passes release the native prompt calls' kept scratch
            for hidden in passes(self.model, ids, 0, self.prefill_chunk, span=self.prefill_span, widen=self._widen):
                out += [self.model.logits(h) for h in hidden]
        self._kv_tokens = list(ids)
        return torch.cat(out)

    @property
    def _widen(self):
        """generate.passes's `widen` for this model: _widened when the plan has a PromptLoan, else None."""
        return self._widened if self.prompt_loan is not None else None

    @contextmanager
    def _widened(self, tokens: int) -> Iterator[int]:
        """A prompt of `tokens` tokens longer than the plan's chunk runs in passes of up to all its tokens in expert
        slots the store lends (store/budget.py PromptLoan): yields the chunk to run with. Afterwards glibc's heaps
        give their free pages back (the passes' blocks live there) before the slots come back, so the process never
        holds both; the heap keeps the plan's chunk's blocks again (keep_heap)."""
        loan = self.prompt_loan
        self._loaned = (0, 0)
        want = loan.borrow(tokens)
        lent = self.store.lend(want, loan.keep) if want else 0
        chunk = loan.chunk_for(tokens, lent) if lent else self.prefill_chunk
        if chunk <= self.prefill_chunk:
            self.store.lend_back()
            yield self.prefill_chunk
            return
        keep_heap(loan.fixed + chunk * loan.per_token)
        self._loaned = (chunk, lent)
        try:
            yield chunk
        finally:
            keep_heap(self.load_plan.prefill_bytes)
            trim_heap()
            self.store.lend_back()

    def forget_cache(self) -> None:
        """Say that the KV cache is about to be overwritten outside generation: no later request reuses its prefix
        or the last prompt's hidden state."""
        self._kv_tokens, self._memo = [], PromptMemo()

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        return self.prompts.check_ids(ids)

    @property
    def max_context(self) -> int:
        """KV positions: prompt and completion together."""
        return self.cache.max_context

    # -- generation ----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: ids pass through; text is tokenized (through the chat template if `chat`)."""
        return self.prompts.encode_prompt(prompt, chat)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the assistant's turn."""
        return self.prompts.encode_chat(messages)

    def generate_tokens(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        chat: bool = False,
        stop_at_eos: bool = True,
    ) -> Iterator[int]:
        """Yield generated token ids (EOS ends generation and is not yielded)."""
        ids = self.encode_prompt(prompt, chat=chat)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        max_tokens = min(max_tokens, self.cache.max_context - len(ids))
        if max_tokens < 1:
            raise RequestError(f"prompt of {len(ids)} tokens leaves no room in the context of {self.cache.max_context}")
        sampler = make_sampler(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
        processors = make_logits_processors(repetition_penalty)
        yield from self._run(ids, sampler, processors, max_tokens, self._reused_prefix(ids), stop_at_eos)

    def _reused_prefix(self, ids: list[int]) -> int:
        """How many leading positions of `ids` the cache already holds and the request may start after (multi-turn
        chat re-sends the history). Keys and values (and latents) are per position: the longest common prefix with
        what the cache holds, at most all but the last token. A Gated DeltaNet layer's recurrent state is not: it is
        the state after everything the cache holds and cannot be cut back, so such a model reuses the cache only
        when `ids` starts with all of it -- and all of `ids` only when the last prompt's hidden state is kept
        (generate.PromptMemo) -- else nothing (the prompt runs from position 0, which zeroes the state)."""
        held = self._kv_tokens
        if self.cache.rewinds:
            start = 0
            for a, b in zip(held, ids[:-1]):
                if a != b:
                    break
                start += 1
            return start
        n = len(held)
        if n and ids[:n] == held and (n < len(ids) or self._memo.ids == ids):
            return n
        return 0

    def _run(self, ids: list[int], sampler: Sampler, processors: Sequence[LogitsProcessor], max_tokens: int,
             start: int = 0, stop_at_eos: bool = True) -> Iterator[int]:
        """The one loop under generate_tokens, generate, replay, the server's jobs and the bench: `generate_step`
        with the thread governor's tick between forward passes. However the caller stops, it leaves `last_tokens`,
        `step_times`, the fault counters and the record of what the KV cache holds consistent."""
        self._kv_tokens, self.last_tokens, self.step_times = [], [], StepTimes()  # the record is invalid meanwhile
        self._prefill_io = None
        self._apply_threads()
        f0 = counters()
        io0 = self._io_counters()
        with torch.inference_mode():
            gen = generate_step(self.model, ids, sampler, processors, max_tokens, start, self.prefill_chunk,
                                self.prefill_span, self.step_times, between=self._tick, memo=self._memo,
                                widen=self._widen)
            try:
                for token in gen:
                    if self._prefill_io is None:  # the prefill just ended (the first token comes with it)
                        read, disk, by_layer = self._io_counters()
                        self._prefill_io = (read - io0[0], disk - io0[1], [b - a for a, b in zip(io0[2], by_layer)])
                    if stop_at_eos and token in self.eos_ids:
                        break
                    self.last_tokens.append(token)
                    yield token
            finally:
                gen.close()
                f1 = counters()
                self._gen_faults = (f1[0] - f0[0], f1[1] - f0[1], f1[2] - f0[2])
                # every yielded token but the last has been fed back through the model
                self._kv_tokens = ids + self.last_tokens[:-1] if self.last_tokens else list(ids)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, stop: Sequence[str] | str | None = None,
                 cancelled: Callable[[], bool] | None = None, **kw) -> Iterator[str]:
        """Yield text pieces; stop strings end generation (the stop text is not yielded). `last_tokens` holds ids.

        `cancelled()`, when given, is asked after every token; True ends the generation there. Keyword arguments:
        temperature, top_p, top_k, min_p, repetition_penalty, seed, chat (apply the chat template to a text prompt).
        """
        self._need_tokenizer("use generate_tokens with token ids")
        tokens = self.generate_tokens(prompt, max_tokens=max_tokens, **kw)
        yield from TextStream(tokens, self.tokenizer.stream_decoder(), max_tokens, stop, cancelled)

    def replay(
        self, prompt: Sequence[int], tokens: Sequence[int], on_step: Callable[[int], None] | None = None
    ) -> list[int]:
        """Teacher forcing: prefill `prompt`, then feed `tokens` one per step whatever the model would pick.

        Returns the greedy argmax after the prompt and after each fed token (len(tokens) + 1 ids), so an arm's
        choices can be checked against a reference while every arm does identical work. Step times land in
        `step_times` and stats() like a generation's. `on_step(n)` is called (outside the timed steps) each time
        the cache holds n tokens: once after the prefill, then after every fed token -- benchmarks read their
        counters there.
        """
        n = len(self._check_ids(prompt))
        ids = self._check_ids(list(prompt) + list(tokens))
        teacher = Teacher(ids[n:])
        for i, _ in enumerate(self._run(ids[:n], teacher, (), len(ids) - n + 1, stop_at_eos=False)):
            if on_step is not None:
                on_step(n + i)
        self.last_tokens = ids[n:]
        return teacher.argmax

    # -- stats ---------------------------------------------------------------------------------------------------
    def bytes_read(self, store_stats: dict | None = None) -> int:
        """Bytes the expert store, the lazily read embedding rows and the n-gram tables have read since load
        (`store_stats`: the store's stats() when the caller already has them)."""
        st = self.store.stats() if store_stats is None else store_stats
        rows = self.rows.stats().get("bytes_read", 0) if self.rows is not None else 0
        return st.get("bytes_read", 0) + rows + sum(t.stats()["bytes_read"] for t in self.tables.values())

    def _io_counters(self) -> tuple:
        """(bytes_read(), disk read bytes, expert reads per layer): what the prefill's share of stats() is a delta
        of."""
        st = self.store.stats()
        by_layer = st.get("misses_by_layer") or [0] * self.spec.n_layers
        return self.bytes_read(st), counters()[2], by_layer

    def _prefill_stats(self) -> dict:
        """The last prefill's reads: bytes (expert store + embedding rows), disk bytes, per prompt token, and the
        expert reads per layer (each touched expert once per chunk when the budget holds a layer's experts); where it
        ran in borrowed expert slots (_widened), its tokens a pass and the bytes lent."""
        io = self._prefill_io
        n = self.step_times.prefill_tokens
        if io is None or not n:
            return {}
        read, disk, by_layer = io
        loan = {} if not self._loaned[1] else {"prefill_pass_tokens": self._loaned[0],
                                                 "prefill_lent_bytes": self._loaned[1]}
        return {"prefill_bytes_read": read, "prefill_bytes_per_token": round(read / n, 1),
                "prefill_disk_read_bytes": disk,
                "prefill_expert_reads_by_layer": by_layer, **loan}

    def stats(self) -> dict:
        """Counters of the last generation and of the store, with derived rates; all JSON-serialisable."""
        t = self.step_times
        dec = sorted(t.decode_s)
        decode_ms = 1000 * sum(dec) / len(dec) if dec else 0.0
        st = self.store.stats()
        hits, misses = st.get("hits", 0), st.get("misses", 0)
        out = {
            "tokens": len(self.last_tokens),
            "prompt_tokens": t.prefill_tokens,
            "prefill_ms": round(1000 * t.prefill_s, 3),
            "prefill_tok_s": round(t.prefill_tokens / t.prefill_s, 2) if t.prefill_s else 0.0,
            "ms_per_token": round(decode_ms, 3),
            "decode_ms_median": round(1000 * dec[len(dec) // 2], 3) if dec else 0.0,
            "decode_tok_s": round(1000 / decode_ms, 2) if decode_ms else 0.0,
            "hits": hits,
            "misses": misses,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "bytes_read": st.get("bytes_read", 0),
            "major_faults": self._gen_faults[0],
            "minor_faults": self._gen_faults[1],
            "disk_read_bytes": self._gen_faults[2],  # /proc/self/io read_bytes: what the disk really delivered
            **memory_status(),
            "resident_bytes": self.resident_bytes,
            "expert_bytes": getattr(self.store, "nbytes", 0),
            "kv_cache_bytes": self.cache.nbytes,
            "prefill_chunk": self.prefill_chunk,
            "prefill_span": self.prefill_span,
            "load_s": round(self.load_s, 3),
            "io": self.options.io,
            "odirect": self.odirect,
            "memory": self.memory,  # the budget in bytes; None = everything resident
            "memory_plan": self.load_plan.describe_memory(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "matmul": "bf16" if self.compute.bf16_gemm else "float32",  # how a prompt's bf16 rows multiply
            "isa": self.options.isa,  # the cap on the kernels' instruction sets (Compute.path)
            "threads": self._threads,
            "thread_changes": self.governor.changes if self.governor is not None else 0,
        }
        if self.rows is not None:
            rs = self.rows.stats()
            out.update(embedding_rows_read=rs["rows_read"], embedding_bytes_read=rs["bytes_read"])
        if self.tables:
            ts = [t.stats() for t in self.tables.values()]
            out.update(ple=self.load_plan.ple, ple_rows=sum(t["rows_distinct"] for t in ts),
                       ple_bytes_read=sum(t["bytes_read"] for t in ts),
                       ple_wait_s=round(sum(t["wait_s"] for t in ts), 6))
        out.update(self._prefill_stats())
        out.update({k: v for k, v in st.items() if k not in out})
        return out

    def close(self) -> None:
        """Stop I/O workers and release files."""
        self.store.close()
        if self.rows is not None:
            self.rows.close()
        for table in self.tables.values():
            table.close()
        for reader in self._own_readers:
            reader.close()
        self.reader.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: str | os.PathLike, *, progress: bool = False, **options) -> Model:
    """Load an MoE checkpoint: a Hugging Face or MLX folder, or a .gguf file.

    Options (see `LoadOptions`): memory ("auto" (default), "all" / None = resident, bytes or "4GiB"), io ("mmap" |
    "willneed" | "direct"), io_workers, io_engine, odirect, dtype ("auto" | "float32" | "bfloat16" | "float16"), max_context,
    prefill_chunk, threads, embeddings, ple, prefetch, prefetch_margin, prompt_prefetch, overlap.
    `sluice.plan.plan(path, options)` shows what a load would decide without reading weights.
    """
    return Model(path, LoadOptions.make(**options), progress=progress)
