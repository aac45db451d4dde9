"""Load options: one declaration per option, from which come the LoadOptions type and its checks, the command-line
flags (`add_load_arguments`), the way back from flags (`options_from_args`) and the README "Options" table
(`options_table`). Unknown names are errors; sizes accept "4GiB" / "512MB".

A new option is one `option(...)` field below, the code that uses it, and a test; every command that loads a model
(run, chat, serve, inspect, bench arms) gets its flag from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError
from .units import format_bytes, parse_size  # noqa: F401  (re-exported: the flags' sizes)
from .io import DEFAULT_WORKERS, ROW_WORKERS
from .io.engines import URING_DEPTH
from .io import MODES as IO_MODES
from .quant.matmul import MATMUL_MODES
from .store.rows import MODES as EMBEDDING_MODES

PREFETCH_MODES = ("auto", "none", "router", "learned")
PLE_MODES = ("auto", *EMBEDDING_MODES)
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}

# Direct-read threads: each is a read in flight. The disk saturates at ~8 threads (io/direct.py's table: 8 and 16 are
# within noise of each other; the io_uring's one thread gains up to 16 in flight: io/direct.py URING_DEPTH), and each
# thread holds a staging buffer of up to 8 MiB: 64 leaves room for deeper NVMe
# queues while 10^5 threads (a traceback) or 10^9 (an OOM kill) cannot be asked for.
MAX_IO_WORKERS = 64
# Compute threads: more than the machine's logical CPUs only makes them wait on each other (and 100,000 of them
# crashed torch under a task limit).
MAX_THREADS = os.cpu_count() or 1

def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --- the declaration ----------------------------------------------------------------------------------------------

_OPTION = "sluice.option"  # the dataclass field metadata key holding an Option


@dataclass(frozen=True)
class Option:
    """How one LoadOptions field is checked, offered as a flag and documented; the field's default is the default.

    The kind of check follows from what is given: `parse` (a function value -> value raising ConfigError),
    `choices` (strings; `aliases` are accepted and normalized first), `boolean` (a --x / --no-x flag; None is
    accepted when the default is None, meaning auto) or `least` (an integer >= least, and <= `most` when given,
    `most_why` saying why).
    """

    help: str  # --help text; " (default: SHOWN)" is appended
    doc: str  # the README "Options" table's meaning column
    shown: str | None = None  # the default as people read it where str(default) would mislead (0 = "measured")
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] | None = None
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    boolean: bool = False
    least: int | None = None
    most: int | None = None
    most_why: str = ""

    def check(self, name: str, value: Any, default: Any) -> Any:
        """`value` as the option holds it (a size parsed, an alias resolved); ConfigError naming `name` if bad."""
        if self.parse is not None:
            return self.parse(value)
        if self.choices is not None:
            value = self.aliases.get(value, value) if isinstance(value, str) else value
            if not isinstance(value, str) or value not in self.choices:
                raise ConfigError(f"{name}: {value!r} is not one of {', '.join(self.choices)}")
        elif self.boolean:
            if not (isinstance(value, bool) or (value is None and default is None)):
                auto = " or None (auto)" if default is None else ""
                raise ConfigError(f"{name}: expected True or False{auto}, got {value!r}")
        elif self.least is not None:
            self._check_int(name, value, default)
        return value

    def _check_int(self, name: str, value: Any, default: Any) -> None:
        if _is_int(value) and value >= self.least and (self.most is None or value <= self.most):
            return
        if self.most is not None:
            least = f"{self.least} (the default)" if default == self.least else str(self.least)
            raise ConfigError(f"{name}: must be an integer from {least} to {self.most} ({self.most_why}), got "
                              f"{value!r}")
        if self.least == 1:
            raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        raise ConfigError(f"{name}: must be an integer >= {self.least}, got {value!r}")


def option(default: Any, **declaration: Any) -> Any:
    """A LoadOptions field: its default and its Option declaration (help, doc, checks; see Option)."""
    return dataclasses.field(default=default, metadata={_OPTION: Option(**declaration)})


def _parse_memory(value: Any) -> int | str | None:
    if isinstance(value, str) and value.strip().lower() in ("auto", "all"):
        return None if value.strip().lower() == "all" else "auto"
    if value is None:
        return None
    try:
        return parse_size(value)
    except ConfigError:
        raise ConfigError(f"memory: expected auto, all, or a size like 4GiB / 512MB / a byte count, got "
                          f"{value!r}") from None


def _parse_chunk(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value < 1:
        raise ConfigError(f"prefill_chunk: must be a positive integer, got {value!r} (or auto)")
    return value


#: LoadOptions.activations -> planes of 8-bit codes per activation value (native/q8.c)
ACTIVATION_PLANES = {"int16": 2, "int8": 1}
#: `activations="auto"` codes with int8 below this many stored bits per expert weight (plan.py _activations): Q4_K_M,
#: Q4_0, IQ4_XS, MXFP4 and everything smaller; Q5_K_M, Q6_K, Q8_0 and plain weights keep int16
LOW_BIT_BPW = 5.5


@dataclass
class LoadOptions:
    """How a model is loaded and run: one field per option, each declared with its flag help, README text and check
    (see `option`); build one with `LoadOptions.make(**kwargs)` or from flags with `options_from_args`."""

    # memory: bytes, or "auto" (store/budget.py auto_memory), or None ("all": everything resident, no streaming)
    memory: int | str | None = option(
        "auto", metavar="SIZE|auto|all", parse=_parse_memory,
        help="budget for resident weights + expert cache, e.g. 4GiB; 'all' = everything resident; 'auto' = resident "
             "if the model fits in the memory available (MemAvailable, cgroup limits), else stream experts with that "
             "memory as the budget",
        doc="budget for resident weights + expert slots (`4GiB`, `512MB`); too small -> error naming the smallest "
            "budget that works. `auto`: everything resident if the model, the KV cache and a runtime reserve fit in "
            "the memory this process may take (the smallest of `MemAvailable` and any memory cgroup limit around "
            "it, e.g. a container's), else stream experts with that room as the budget; the stats line says which. "
            "`all`: everything resident")
    # io: also used for the resident load
    io: str = option(
        "direct", choices=IO_MODES, help="how expert bytes are read",
        doc="how expert bytes are read: demand-faulted mapping, mapping + `MADV_WILLNEED`, or `pread` by a worker "
            "pool into owned slot buffers")
    # io_workers 0: the readers' measured defaults (io/direct.py URING_DEPTH for experts on the io_uring,
    # DEFAULT_WORKERS on threads, ROW_WORKERS for a row table's own pool)
    io_workers: int = option(
        0, metavar="N", least=0, most=MAX_IO_WORKERS, most_why="the disk saturates at ~8-16 reads in flight",
        shown=f"measured: {URING_DEPTH} for experts on the io_uring ({DEFAULT_WORKERS} threads without it), "
              f"{ROW_WORKERS} for n-gram table rows",
        help=f"direct reads in flight of each pool (its threads, or the io_uring's depth), at most {MAX_IO_WORKERS}",
        doc="direct reads in flight (both pools: threads, or the io_uring's depth)")
    # io_engine auto: the io_uring where the kernel allows it, else preader.c's threads where the extension is built
    # (io/direct.py resolve_engine says why; the n-gram tables' rows stay on the threads)
    io_engine: str = option(
        "auto", choices=("auto", "native", "uring", "python"), shown="auto (uring where allowed)",
        help="who runs the direct reads: C threads (native), one C thread driving an io_uring (uring), or Python "
             "threads; auto = uring where the kernel allows it, else native where it is built",
        doc="who runs `--io direct`'s reads: C threads that never take the GIL (`native`), one C thread keeping "
            "`--io-workers` reads in flight in an io_uring (`uring`: no thread per read; Linux 5.1+, refused by "
            "some containers' seccomp filters), or Python threads (`python`, the reader before them); `auto`: "
            "uring where the kernel allows it (its one thread, 16 reads in flight: 6-8 ms a streamed token less "
            "than 8 threads on a 2-core VM), else native where the extension built; an n-gram table's rows use native. The same bytes land "
            "either way")
    # odirect None = auto (engine.py): O_DIRECT when streaming and the experts cannot fit in the memory left beside
    # the budget either (then page cache only adds a copy and constant reclaim: buffered reads measured 1.3-1.6x
    # slower in every benchmark under a ceiling), buffered otherwise (a roomy box keeps the model in page cache after
    # the first pass). True / False force it.
    odirect: bool | None = option(
        None, boolean=True, shown="auto",
        help="read with O_DIRECT, bypassing the page cache; auto = on when streaming a model that the memory left "
             "beside the budget could not cache anyway",
        doc="read with `O_DIRECT` so streamed bytes do not also fill the page cache. Auto: on when streaming with "
            "`--io direct` and the experts could not fit in the memory left beside the budget anyway (buffered "
            "reads then only add a copy and constant reclaim: 1.3-1.6x slower in every benchmark below); off when "
            "the page cache can keep the model after one pass")
    # dtype auto: float32 stays float32, bf16 stays bf16 (on this class of CPU bf16 GEMV runs ~1.8x faster than
    # float32, measured 2.8 vs 5.2 ms for 8 experts of 2048x1536); quantized files compute in bf16 (engine.py)
    dtype: str = option(
        "auto", choices=("auto", *COMPUTE_DTYPES), aliases=_DTYPE_ALIASES,
        help="compute dtype; auto = the checkpoint's",
        doc="compute dtype: the checkpoint's (bf16 stays bf16, quantized experts compute in bf16), or float32 / "
            "bfloat16 / float16")
    # activations: the integer kernels' coding of a quantized projection's input (native/q8.c), planes per value:
    # ACTIVATION_PLANES; auto resolved in plan.py (_activations). Peers Q4_K_M, resident, alternated in one process:
    # int16 25.3, int8 20.0 ms/token (`benchmarks/knobs.py arms`); one projection's error: tests/quant/test_q8.py's
    # table
    activations: str = option(
        "auto", choices=("auto", *ACTIVATION_PLANES),
        help="how the integer kernels code a quantized projection's input: int16 (two 8-bit planes, finer than "
             "bf16) or int8 (llama.cpp's Q8_K / Q8_0 coding: faster, also for a prompt's Q4_K projections on "
             "AVX512-VNNI; 0.5-2.3%% error per projection); auto = int8 when the experts average under 5.5 bits "
             "per weight (their own rounding error is 10-40x int8's), else int16",
        doc="how the integer kernels of GGUF block formats code a projection's input at the bf16 / f16 dtypes: "
            "`int16`, two planes of 8-bit codes per 32 values (256 for the K-quants), x to ~1/32,000 of the "
            "block's largest value, finer than bf16 itself; `int8`, one plane, x to 1/127 of it, as llama.cpp's "
            "CPU kernels do (Q8_K / Q8_0): fewer multiplies per weight, 0.5-2.3% error per projection. With `int8` "
            "a prompt's Q4_K projections (experts and attention) also run on 8-bit codes where the CPU has "
            "AVX512-VNNI, instead of a bf16 GEMM on their weights dequantized (`int16`: ~0.2% error; ~1.5x fewer "
            "seconds per multiply). Where a prompt's GEMMs are float32 (no bf16 dot products: AVX2 CPUs, or "
            "`--isa avx2`) its Q4_K, Q5_K and Q6_K projections run on AVX2 integer tiles at either coding (`int16` "
            "two multiplies per weight, `int8` one) instead of dequantizing to float32: a peers expert on 256 rows "
            "4.9 / 2.8 ms against 6.4. `auto`: `int8` when the experts average under 5.5 bits per weight "
            "(Q4_K_M, Q4_0, IQ4_XS, MXFP4 files and everything smaller), whose own rounding moves a weight 7-30% "
            "(Q4_K, Q3_K, Q2_K on the peers model) against int8's 0.5-0.8% (perplexity within 0.02% of int16's on "
            "every such file of the table below), else `int16` (Q5_K_M, Q6_K, Q8_0, plain weights); `sluice "
            "inspect` prints the choice. "
            "float32 keeps the exact float kernels either way")
    # matmul: Compute.bf16_gemm (quant/matmul.py rows_linear, quant/linear.py's many-row path), decided per model at
    # load (engine.py); auto: host/cpus.bf16_dot. Peers bf16 model, resident 2,048-token prefill on a 2-core AVX512_BF16
    # EPYC, the modes alternated in one process: float32 238, bf16 507 tok/s (`benchmarks/prefill/knobs.py
    # matmul-prefill`)
    matmul: str = option(
        "auto", choices=MATMUL_MODES,
        help="how several rows of bf16 activations multiply bf16 weights (prompts): bf16 GEMM or float32; auto = "
             "bf16 where the CPU has bf16 dot-product instructions (AVX512_BF16, AMX)",
        doc="how several rows of bf16 activations (a prompt) multiply bf16 weights: `bf16`, torch's bf16 GEMM; "
            "`float32`, both widened and a float32 GEMM. `auto`: bf16 where the CPU has bf16 dot-product "
            "instructions (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo: 4-5x faster there), float32 elsewhere "
            "(on AVX2 torch's bf16 GEMM has no native kernel and runs ~6x slower). Both accumulate in float32. "
            "Under bf16 a resident model also keeps its bf16 experts packed in oneDNN's layout (the same bits) and "
            "a prompt's attention runs in float32 on bf16 dot products (on its bf16 inputs, torch's flash kernel, "
            "where the CPU has AMX and the pass is long)")
    # isa: the native kernels' path cap, Compute.path (quant/native/_lib.py PATHS), decided per model at load
    isa: str = option(
        "auto", choices=("auto", "avx2", "portable"),
        help="cap the instruction sets sluice's kernels use: auto = the best this CPU has; avx2 = as on a CPU "
             "without AVX-512 (benchmarks; torch's own: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)",
        doc="the instruction sets sluice's native kernels use: `auto`, the best this CPU has; `avx2`, none of the "
            "AVX-512 paths (VNNI prompt tiles, AVX512_BF16 attention and rounding) and `--matmul auto` as on a CPU "
            "without bf16 dot products, so an AVX-512 machine measures what an AVX2-only one runs (torch's own "
            "kernels take the environment: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`, and its MKL float32 "
            "GEMM `MKL_ENABLE_INSTRUCTIONS=AVX2`); `portable`, the "
            "plain C loops. The same bits on every path where the kernels claim them")
    # max_context: capped by the model's max_position_embeddings
    max_context: int = option(4096, metavar="N", least=1, help="KV cache positions",
                              doc="KV cache positions, allocated once")
    # prefill_chunk "auto": plan._prefill_chunk (store/budget.activation_room / prefill_token_bytes, 256-4096)
    prefill_chunk: int | str = option(
        "auto", metavar="N|auto", parse=_parse_chunk, help="prompt tokens per pass; auto: as many as the memory "
        "left beside the weights, KV cache and runtime holds in activations (256-4096)",
        doc="prompt tokens per forward pass during prefill. Streamed, a longer prompt runs layer by layer: each "
            "layer takes every pass of up to a span of tokens (as many as a quarter of the activation room, or of "
            "the smallest pass's, holds in hidden states; at most --max-context) before the next layer starts, so it reads its touched experts "
            "once for the span, not once per pass (same output). `auto`: as many as the memory this process may "
            "still take holds in activations, beside the kept weights, the KV cache and a runtime reserve (half of "
            "it when streamed reads go through the page cache; 64 MiB when the memory is unknown), within "
            "256-4096. Streamed with `auto`, a prompt longer than the pass borrows expert slots while it runs (their "
            "pages go back to the kernel, the passes grow into them, up to the whole prompt or 4096 tokens, and the "
            "slots come back empty afterwards; the store keeps two layers' experts), so `--memory auto` gives the "
            "slots the whole room; where they cannot lend 1024-token passes the budget leaves room for them. An "
            "explicit N's passes are counted before the budget and borrow nothing; `sluice inspect` prints the "
            "figures")
    # threads 0: the CPUs this process may use (affinity mask, capped by a cgroup CPU quota: host/cpus.usable_cpus),
    # fewer while other processes keep CPUs busy (host/cpus.ThreadGovernor)
    threads: int = option(
        0, metavar="N", least=0, most=MAX_THREADS, most_why="this machine's logical CPUs",
        shown="free CPUs", help=f"torch and native threads, at most {MAX_THREADS} (this machine's logical CPUs)",
        doc="torch threads, and the native threads a decode step splits a layer's quantized experts and large "
            "quantized projections over. Default: one per CPU this process may use (affinity, cgroup CPU quota) "
            "that other processes leave free, re-checked between forward passes (see \"A shared machine\" below); "
            "an explicit count is kept")
    # embeddings: forced resident when the LM head is tied to the table
    embeddings: str = option(
        "resident", choices=EMBEDDING_MODES, help="token embedding rows: resident, or read per batch from disk",
        doc="token-embedding rows read per batch from disk instead of held")
    # ple: qwen4_exp's per-layer n-gram tables (models/tables.py, store/rows.py); auto resolved in plan.py _ple
    ple: str = option(
        "auto", choices=PLE_MODES,
        help="per-layer n-gram embedding tables (qwen4_exp): resident, or their rows read per pass from disk through "
             "a mapping (mmap) or the direct-read pool (direct); auto = resident when they fit beside the budget, "
             "else direct",
        doc="qwen4_exp's per-layer n-gram embedding tables (tens of GiB, a few hundred bytes per row read): held "
            "(`resident`), or each pass's distinct rows read from disk, deduplicated and sorted, through the mapping "
            f"(`mmap`: page faults) or the tables' own direct-read pool, {ROW_WORKERS} reads in flight (measured: "
            "`benchmarks/ple`; `--io-workers` sets it) (`direct`). `auto`: resident when the tables fit in the memory left beside the budget, the KV cache and the runtime "
            "reserve, else direct; `sluice inspect` prints the decision. Output is the same in every mode")
    # prefetch: streaming stores only; "learned" reads prerouter.safetensors beside the model (a CheckpointError
    # when missing or stale)
    prefetch: str = option(
        "auto", choices=PREFETCH_MODES, help="predict the next layer's experts and read them in the background; auto = "
                                             "router, paused while its guesses are mostly wrong",
        doc="predict the next layer's experts (its router on the current hidden state, or heads fitted by `sluice "
            "prerouter fit MODEL`) and read them in the background; output is unchanged. `router` is faster where its "
            "guesses are right (the synthetic models' uniform routing, 92-99%) and slower where they are not (the "
            "trained demo, 68%: +55% bytes read; benchmarks/results/prefetch-router); `auto` (the default) guesses "
            "as `router` does with `--io direct` and pauses while fewer than 80% of the guessed reads are used, "
            "longer each time it fails again")
    prefetch_margin: int = option(0, metavar="N", least=0, help="experts predicted beyond top_k per token",
                                  doc="experts predicted beyond top_k")
    prompt_prefetch: bool = option(
        True, boolean=True, shown="on", help="streaming: read the next layer's experts during a prompt's expert math",
        doc="streaming: while a prompt runs a layer's experts, the next layer's likely experts (its router on the "
            "current hidden state) are read into the slots left free, for prompts of at least num_experts / top_k "
            "tokens (they touch most experts, so the reads are rarely wasted); output is unchanged")
    overlap: bool = option(
        True, boolean=True, shown="on", help="run a layer's experts that are in memory while the others are read",
        doc="streaming: a layer's experts already in memory run while the others are read, each as soon as its "
            "bytes land; outputs are summed in a fixed order, so the result is bitwise the same")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.metadata[_OPTION].check(f.name, getattr(self, f.name), f.default))

    @classmethod
    def make(cls, **kwargs) -> "LoadOptions":
        """Build from keyword arguments; an unknown name is a ConfigError listing the known ones."""
        _check_names(cls, kwargs)
        return cls(**kwargs)

    def compute_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The dtype the math runs in."""
        if self.dtype != "auto":
            return COMPUTE_DTYPES[self.dtype]
        return checkpoint_dtype if checkpoint_dtype in COMPUTE_DTYPES.values() else torch.float32


# --- what the declaration generates ----------------------------------------------------------------------------------


def declarations(cls: type | None = None) -> list[tuple[dataclasses.Field, Option]]:
    """(field, Option) per load option of `cls` (default: LoadOptions, looked up when called), in declaration order."""
    return [(f, f.metadata[_OPTION]) for f in dataclasses.fields(cls or LoadOptions)]


def flag(name: str) -> str:
    """The command-line flag of option `name`: io_workers -> --io-workers."""
    return "--" + name.replace("_", "-")


def _check_names(cls: type, names: Iterable[str]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _shown(f: dataclasses.Field, opt: Option) -> str:
    return opt.shown if opt.shown is not None else str(f.default)


def add_load_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, only: Iterable[str] | None = None,
                       defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
                       cls: type | None = None) -> None:
    """One flag per load option on `parser` (a parser or an argument group): `--io-workers N` with dest io_workers,
    `--odirect / --no-odirect` for a boolean, argparse choices for a choice. `only`: the option names to offer
    (default: all). `defaults`: name -> the flag's default where a command's differs from LoadOptions'
    (argparse.SUPPRESS keeps an absent flag out of the namespace). `helps`: name -> a help text replacing the
    declared one. `cls`: the options class (default LoadOptions). An unknown name is a ConfigError."""
    cls = cls or LoadOptions
    names = None if only is None else set(only)
    defaults, helps = dict(defaults or {}), dict(helps or {})
    _check_names(cls, [*(names or ()), *defaults, *helps])
    for f, opt in declarations(cls):
        if names is not None and f.name not in names:
            continue
        default = defaults.get(f.name, f.default)
        if f.name in helps or default is argparse.SUPPRESS:
            text = helps.get(f.name, opt.help)
        else:
            text = f"{opt.help} (default: {default if f.name in defaults else _shown(f, opt)})"
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
        if opt.boolean:
            kw["action"] = argparse.BooleanOptionalAction
        elif opt.choices is not None:
            kw["choices"] = opt.choices
        else:
            kw["metavar"] = opt.metavar
            if opt.least is not None:
                kw["type"] = int
        parser.add_argument(flag(f.name), **kw)


def option_kwargs(namespace: argparse.Namespace, cls: type | None = None) -> dict[str, Any]:
    """The load options an argparse namespace holds (attributes named like a field), as keyword arguments of
    `LoadOptions.make` / `sluice.load`; options whose flags were not added (or were SUPPRESSed) are left out."""
    return {f.name: getattr(namespace, f.name) for f, _ in declarations(cls) if hasattr(namespace, f.name)}


def options_from_args(namespace: argparse.Namespace, cls: type | None = None) -> LoadOptions:
    """LoadOptions from the flags `add_load_arguments` added (the others keep their defaults); ConfigError if bad."""
    cls = cls or LoadOptions
    return cls.make(**option_kwargs(namespace, cls))


def _usage(name: str, opt: Option) -> str:
    if opt.boolean:
        return f"{flag(name)} / --no-{flag(name)[2:]}"
    if opt.choices is not None:
        return f"{flag(name)} {'|'.join(opt.choices)}"
    return f"{flag(name)} {opt.metavar}" if opt.metavar else flag(name)


def options_table(cls: type | None = None) -> str:
    """The README "Options" table rows for the load options (markdown; tests/test_options.py checks README has it)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f, opt in declarations(cls):
        cells = (f"`{_usage(f.name, opt)}`", _shown(f, opt), opt.doc)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
