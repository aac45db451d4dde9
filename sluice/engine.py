"""`sluice.load(path, ...)` -> Model: the public Python API (DESIGN.md "Public contracts").

Wires the components: CheckpointIndex (where bytes are) -> reader (how bytes move) -> ExpertStore (what stays in
memory) -> Transformer (math) -> generate loop, tokenizer and sampler.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from .checkpoint.index import CONFIG, GENERATION_CONFIG, CheckpointIndex
from .errors import ConfigError, ContextLengthError, RequestError, SluiceError
from .generate import StepTimes, decode_one, generate_step, prefill
from .io import DEFAULT_WORKERS, make_reader
from .models import model_args
from .models.args import GenerationArgs, eos_ids
from .models.schema import parse
from .models.blocks import Transformer
from .models.spec import KVCache
from .options import LoadOptions, format_bytes
from .sampling import make_logits_processors, make_sampler
from .store.layout import ExpertLayout
from .store.budget import RUNTIME_RESERVE, AutoPlan, auto_memory, check_room, prefill_tokens_per_chunk
from .store.resident import ResidentExpertStore
from .tokenizer.limit import PIECE, tokens_at_least
from .prerouter.predict import PREROUTER_FILE, LearnedPrerouter, RouterPrerouter, model_fingerprint
from .store.rows import RowTable
from .tokenizer import StopMatcher, Tokenizer
from .tokenizer.gguf import tokenizer_from_gguf
from .host.procstat import counters, memory_status
from .host.cpus import ThreadGovernor, usable_cpus
from .host.memory import MemoryRoom, available_memory
from .store.weights import load_resident, resident_refs


def _eos_ids(args, generation: GenerationArgs, tok: Tokenizer | None) -> set[int]:
    """End-of-sequence ids: generation_config.json's and config.json's (both validated), and the tokenizer's."""
    ids = eos_ids(generation.eos_token_id, args.eos_token_id)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    ids.update(getattr(tok, "eog_token_ids", ()))  # a GGUF vocabulary's end-of-generation tokens (llama.cpp's)
    return ids


class Model:
    """A loaded model. `logits(ids)`, `generate(prompt, ...)`, `stats()`; `last_tokens` holds the last output ids."""

    def __init__(self, path: str | os.PathLike, options: LoadOptions, progress: bool = False):
        t0 = time.perf_counter()
        self.path = Path(path)
        self.options = options
        self.index = CheckpointIndex.open(self.path)
        self.arch, self.args = model_args(self.index.config, self.index.folder / CONFIG)
        generation = parse(GenerationArgs, self.index.generation_config or {},
                           source=str(self.index.folder / GENERATION_CONFIG))
        self.spec = self.args.spec()
        s = self.spec
        refs = resident_refs(self.index, s, self.arch)
        q = refs["layers.0.q"]
        # a quantized checkpoint (GGUF Q4_K, ...) has no dtype of its own: its dequantized weights compute in bf16
        # unless asked otherwise (dtype=float32 is the exact reference)
        self.dtype = options.compute_dtype(torch.bfloat16 if q.quantized else q.torch_dtype)
        self.prefill_chunk = (prefill_tokens_per_chunk(s, self.dtype.itemsize) if options.prefill_chunk == "auto"
                              else options.prefill_chunk)
        # threads 0 (default): one per CPU this process may use (torch's own default ignores cgroup CPU quotas),
        # fewer while other processes keep CPUs busy (ThreadGovernor); an explicit count is kept as given
        threads = options.threads or usable_cpus()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.governor = ThreadGovernor(threads) if not options.threads and threads > 1 else None
        self.layout = ExpertLayout(self.index, s, self.arch)
        lazy_embed = options.embeddings != "resident" and not s.tie_word_embeddings
        if lazy_embed and refs["embed"].quantized:
            raise ConfigError(f"embeddings: {options.embeddings!r} reads plain rows, and this checkpoint stores the "
                              f"token embeddings as {refs['embed'].dtype}: use --embeddings resident")
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        self.resident_bytes = itemsize * sum(r.numel for k, r in refs.items() if not (lazy_embed and k == "embed"))
        max_ctx = min(options.max_context, s.rope.max_position_embeddings)
        self.cache = KVCache(s, max_ctx, self.dtype)  # torch.empty: costs nothing until positions are written
        # the budget: None = everything resident; decided before any weight is loaded, so a model that cannot fit
        # fails with a BudgetError instead of an OOM kill
        self.memory, self.memory_plan = options.memory, None
        room = available_memory()
        if options.memory == "auto":
            self.memory_plan = self._auto_memory(room)
            self.memory = self.memory_plan.memory
        else:
            check_room(self.memory, room.bytes, room.source, self.resident_bytes, self.layout.expert_nbytes,
                       self.layout.total_experts, self.cache.nbytes)
        self.odirect = self._odirect(room)
        self.reader = make_reader(options.io, workers=options.io_workers or DEFAULT_WORKERS, odirect=self.odirect)
        # read each weight file only as the version whose header was read: a shard replaced, truncated or rewritten
        # while the model runs is a CheckpointError naming it (io/base.py FileGuard), not a SIGBUS or wrong bytes
        self.reader.expect(self.index.stamps())
        weights = load_resident(refs, s, self.dtype, lazy_embed=lazy_embed)
        self.rows = self._make_rows(refs["embed"]) if lazy_embed else None
        self.store = self._make_store(progress)
        prerouter = None
        if options.prefetch == "router" and self.memory is not None:
            prerouter = RouterPrerouter(s, weights, margin=options.prefetch_margin)
        elif options.prefetch == "learned" and self.memory is not None:
            fingerprint = model_fingerprint(s, self.index.config, refs)
            prerouter = LearnedPrerouter.load(self.path / PREROUTER_FILE, s, fingerprint, options.prefetch_margin)
        self.model = Transformer(s, weights, self.store, self.cache, self.dtype, rows=self.rows, prerouter=prerouter)
        self.tokenizer = self._tokenizer()
        self.eos_ids = _eos_ids(self.args, generation, self.tokenizer)
        self.load_s = time.perf_counter() - t0
        self.last_tokens: list[int] = []
        self._kv_tokens: list[int] = []  # tokens whose keys/values are in the cache, in order
        self._times = StepTimes()
        self._gen_faults = (0, 0, 0)
        self._generated = 0

    def _tokenizer(self) -> Tokenizer | None:
        """tokenizer.json of a model folder, or the tokenizer a GGUF file carries in its metadata.

        A GGUF whose tokenizer sluice cannot rebuild (an unknown pre-tokenizer, missing merges) still runs on token
        ids: the error is kept and raised, naming the key, when text has to be encoded."""
        metadata = getattr(self.index, "metadata", None)
        if metadata is None:
            return Tokenizer.from_folder(self.path) if (self.path / "tokenizer.json").exists() else None
        if "tokenizer.ggml.model" not in metadata:
            self._no_tokenizer = f"{self.path} carries no tokenizer (tokenizer.ggml.model)"
            return None
        try:
            return tokenizer_from_gguf(metadata, str(self.path))
        except SluiceError as e:
            self._no_tokenizer = f"its tokenizer cannot be used: {e}"
            return None

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            why = getattr(self, "_no_tokenizer", f"{self.path} has no tokenizer.json")
            raise ConfigError(f"{why}: {what}")
        return self.tokenizer

    def _tick(self) -> None:
        """Between forward passes: match the thread count to the CPUs other processes leave free."""
        if self.governor is not None:
            self.governor.tick()

    def _make_rows(self, ref) -> RowTable:
        mode = self.options.embeddings
        # share the reader when it is of the kind the table needs; otherwise the table makes its own
        same = (mode == "direct") == (self.options.io == "direct")
        return RowTable(ref, mode, reader=self.reader if same else None, dtype=self.dtype)

    def _odirect(self, room: MemoryRoom) -> bool:
        """options.odirect, or when None: O_DIRECT iff streaming with the direct reader and all the experts would
        not fit in the memory left beside the budget, the KV cache and the runtime (see LoadOptions.odirect)."""
        if self.options.odirect is not None:
            return self.options.odirect
        if self.memory is None or self.options.io != "direct":
            return False
        left = room.bytes - self.memory - self.cache.nbytes - RUNTIME_RESERVE
        return self.layout.total_experts * self.layout.expert_nbytes > left

    def _auto_memory(self, room: MemoryRoom) -> AutoPlan:
        return auto_memory(room.bytes, room.source, self.resident_bytes, self.layout.expert_nbytes,
                           self.layout.total_experts, self.spec.top_k, self.cache.nbytes)

    def _make_store(self, progress: bool):
        if self.memory is None:
            return ResidentExpertStore(self.layout, self.reader, self.dtype, progress=progress)
        from .store.streaming import StreamingExpertStore

        return StreamingExpertStore.with_budget(self.layout, self.reader, self.memory - self.resident_bytes,
                                                self.memory, overlap=self.options.overlap)

    # -- logits --------------------------------------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Full-sequence prefill logits [T, vocab] in float32, from an empty cache."""
        ids = self._check_ids(ids)
        self._kv_tokens = []
        chunk = self.prefill_chunk
        out = []
        with torch.inference_mode():
            for start in range(0, len(ids), chunk):
                part = torch.tensor(ids[start : start + chunk], dtype=torch.long)
                out.append(self.model.logits(self.model.forward(part, start)))
        self._kv_tokens = list(ids)
        return torch.cat(out)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if not ids:
            raise RequestError("empty prompt: need at least one token")
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} out of range [0, {self.spec.vocab_size})")
        if len(ids) > self.cache.max_context:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens exceeds the context of {self.cache.max_context} (max_context option)"
            )
        return ids

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize `text`, refusing one longer than the context before tokenizing all of it (see prompt_limit)."""
        ctx = self.cache.max_context
        if len(text) > PIECE:  # shorter texts cost less to tokenize whole than to bound
            floor = tokens_at_least(self.tokenizer, text, ctx)
            if floor.tokens > ctx:
                raise ContextLengthError(
                    f"prompt of {len(text):,} characters exceeds the context of {ctx} tokens (max_context option): "
                    f"its first {floor.chars:,} characters are already at least {floor.tokens:,} tokens"
                )
        return self._check_ids(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- generation ----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: ids pass through; text is tokenized (through the chat template if `chat`)."""
        if not isinstance(prompt, str):
            return self._check_ids(prompt)
        self._need_tokenizer("pass token ids instead of text")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self._encode_text(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the assistant's turn."""
        self._need_tokenizer("chat needs one")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self._encode_text(text, add_special_tokens=False)

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
        # Reuse the cached keys/values of the longest common prefix (multi-turn chat re-sends the history).
        start = 0
        for a, b in zip(self._kv_tokens, ids[:-1]):
            if a != b:
                break
            start += 1
        self._kv_tokens = []  # invalid while the loop runs; set again below
        self.last_tokens = []
        self._times = StepTimes()
        f0 = counters()
        with torch.inference_mode():
            gen = generate_step(
                self.model, ids, sampler, processors, max_tokens, start, self.prefill_chunk, self._times,
                between=self._tick,
            )
            try:
                for token in gen:
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

    def generate(
        self, prompt: str | Sequence[int], max_tokens: int = 256, stop: Sequence[str] | str | None = None, **kw
    ) -> Iterator[str]:
        """Yield text pieces; stop strings end generation (the stop text is not yielded). `last_tokens` holds ids.

        Keyword arguments: temperature, top_p, top_k, min_p, repetition_penalty, seed, chat (apply the chat
        template to a text prompt).
        """
        self._need_tokenizer("use generate_tokens with token ids")
        decoder = self.tokenizer.stream_decoder()
        matcher = StopMatcher(stop or []) if stop else None
        gen = self.generate_tokens(prompt, max_tokens=max_tokens, **kw)
        try:
            for token in gen:
                piece = decoder.add(token)
                if matcher is not None:
                    piece, stopped = matcher.feed(piece)
                    if piece:
                        yield piece
                    if stopped:
                        return
                elif piece:
                    yield piece
            tail = decoder.flush()
            if matcher is not None:
                tail, _ = matcher.feed(tail)
                tail += "" if matcher.stopped else matcher.flush()
            if tail:
                yield tail
        finally:
            gen.close()

    def replay(
        self, prompt: Sequence[int], tokens: Sequence[int], on_step: Callable[[int], None] | None = None
    ) -> list[int]:
        """Teacher forcing: prefill `prompt`, then feed `tokens` one per step whatever the model would pick.

        Returns the greedy argmax after the prompt and after each fed token (len(tokens) + 1 ids), so an arm's
        choices can be checked against a reference while every arm does identical work. Step times land in
        stats() like a generation's. `on_step(n)` is called (outside the timed region) each time the cache holds n
        tokens: once after the prefill, then after every fed token -- benchmarks read their counters there.
        """
        ids = self._check_ids(list(prompt) + list(tokens))
        n = len(prompt)
        self._kv_tokens, self.last_tokens, self._times = [], [], StepTimes()
        f0 = counters()
        argmax: list[int] = []
        with torch.inference_mode():
            t0 = time.perf_counter()
            hidden = prefill(self.model, ids[:n], 0, self.prefill_chunk, self._tick)
            argmax.append(int(self.model.logits(hidden)[0].argmax()))
            self._times.prefill_tokens, self._times.prefill_s = n, time.perf_counter() - t0
            if on_step is not None:
                on_step(n)
            for pos in range(n, len(ids)):
                self._tick()
                t0 = time.perf_counter()
                hidden = decode_one(self.model, ids[pos], pos)
                argmax.append(int(self.model.logits(hidden)[0].argmax()))
                self._times.decode_s.append(time.perf_counter() - t0)
                if on_step is not None:
                    on_step(pos + 1)
        f1 = counters()
        self._gen_faults = (f1[0] - f0[0], f1[1] - f0[1], f1[2] - f0[2])
        self._kv_tokens = ids
        self.last_tokens = list(tokens)
        return argmax

    # -- stats ---------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of the last generation and of the store, with derived rates; all JSON-serialisable."""
        t = self._times
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
            "load_s": round(self.load_s, 3),
            "io": self.options.io,
            "odirect": self.odirect,
            "memory": self.memory,  # the budget in bytes; None = everything resident
            "memory_plan": self.memory_plan.describe() if self.memory_plan else
            ("everything resident" if self.memory is None else f"budget {format_bytes(self.memory)}"),
            "dtype": str(self.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "thread_changes": self.governor.changes if self.governor is not None else 0,
        }
        if self.rows is not None:
            rs = self.rows.stats()
            out.update(embedding_rows_read=rs["rows_read"], embedding_bytes_read=rs["bytes_read"])
        out.update({k: v for k, v in st.items() if k not in out})
        return out

    def close(self) -> None:
        """Stop I/O workers and release files."""
        self.store.close()
        if self.rows is not None:
            self.rows.close()
        self.reader.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: str | os.PathLike, *, progress: bool = False, **options) -> Model:
    """Load a Hugging Face MoE checkpoint folder.

    Options (see `LoadOptions`): memory ("auto" (default), "all" / None = resident, bytes or "4GiB"), io ("mmap" | "willneed" | "direct"),
    io_workers, odirect, dtype ("auto" | "float32" | "bfloat16" | "float16"), max_context, prefill_chunk, threads.
    """
    return Model(path, LoadOptions.make(**options), progress=progress)
