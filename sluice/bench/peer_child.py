"""One peer run in a fresh process, in the peers' environment: `PYTHON peer_child.py replay --peer KIND ...`.

Run as a script by the interpreter of benchmarks/peers/.venv (see sluice/bench/peers.py), so it imports nothing from
the sluice package (that would load torch into a llama.cpp run): the standard library, sluice/host/procstat.py loaded
by path, and the peer's own packages inside its function. It prints one JSON line shaped
like sluice's child's record (argmax, step times, the timed window's counters, peak RSS), so the bench summarizes,
pairs and identity-checks peers exactly as it does sluice's arms.

    llama.cpp   llama_cpp.Llama on a GGUF, with llama.cpp's defaults (its repacked CPU buffers on) unless the arm
                turns repacking off; the prompt is evaluated in one batch, then each recorded token with
                Llama.eval([token]) (teacher forcing); argmax of the logits llama.cpp computed for the last position.
    accelerate  transformers from_pretrained(device_map="auto", max_memory={"cpu": ...}, offload_folder=...): what
                does not fit is offloaded to disk; a forward over the prompt, then one forward per recorded token
                with the KV cache (past_key_values).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import inspect
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20, "G": 1e9, "GB": 1e9,
          "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'256MiB' -> bytes (the same spellings as sluice's --memory)."""
    m = _SIZE.match(text)
    if not m or (m.group(2) or "").upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _load_procstat():
    """sluice/host/procstat.py (standard library only) loaded by path: the kernel counters sluice's own child reads,
    without importing the sluice package (which would pull torch into a llama.cpp run's memory)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "host", "procstat.py")
    spec = importlib.util.spec_from_file_location("sluice_procstat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_procstat = _load_procstat()
disk_read_bytes, memory_status = _procstat.disk_read_bytes, _procstat.memory_status


def counters() -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"disk_read_bytes": disk_read_bytes(), "major_faults": ru.ru_majflt, "minor_faults": ru.ru_minflt,
            "cpu_s": ru.ru_utime + ru.ru_stime, "wall_s": time.perf_counter()}


def evict(path: str) -> None:
    """Drop a file's clean pages from the page cache (written pages are synced first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Steps:
    """Per-step times and counters of a replay; the timed window opens after `warmup` decode steps."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.step_s: list[float] = []
        self.marks: list[dict[str, float]] = []  # counters after the prefill and after each decode step

    def mark(self) -> None:
        self.marks.append(counters())

    def record(self) -> dict[str, Any]:
        start, end = self.marks[self.warmup], self.marks[-1]
        window = {k: end[k] - start[k] for k in end}
        timed = self.marks[self.warmup:]
        window.update(steps=len(self.step_s) - self.warmup, hits=0, misses=0)  # no expert cache: no hit rate
        return {
            "warmup_step_s": self.step_s[:self.warmup],
            "step_s": self.step_s[self.warmup:],
            "step_disk_read_bytes": [b["disk_read_bytes"] - a["disk_read_bytes"] for a, b in zip(timed, timed[1:])],
            "step_major_faults": [b["major_faults"] - a["major_faults"] for a, b in zip(timed, timed[1:])],
            "window": window,
        }


# -- llama.cpp -------------------------------------------------------------------------------------------------------
_MADVISE = {"random": 1, "sequential": 2, "willneed": 3}  # MADV_* on Linux


def madvise_file_mappings(path: str, advice: str) -> int:
    """madvise every mapping of `path` in this process (llama.cpp's mmap of the GGUF); returns bytes advised."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    real, total = os.path.realpath(path), 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if libc.madvise(lo, hi - lo, _MADVISE[advice]) != 0:
                    raise OSError(ctypes.get_errno(), f"madvise({advice}) failed on {real}")
                total += hi - lo
    return total


def with_extra_bufts(defaults, extra_bufts: bool | None):
    """llama_model_default_params with use_extra_bufts set to `extra_bufts`; `defaults` itself when None (llama.cpp's
    own choice, repacking on) or when this llama.cpp has no such field."""
    if extra_bufts is None:
        return defaults

    def model_params():
        p = defaults()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = bool(extra_bufts)
        return p

    return model_params


def replay_llama_cpp(opts: dict[str, Any], prompt: list[int], tokens: list[int], warmup: int) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    threads = opts.get("threads") or os.cpu_count() or 1
    params: dict[str, Any] = dict(
        model_path=opts["gguf"], n_ctx=max(512, len(prompt) + len(tokens) + 16), n_batch=opts.get("n_batch", 512),
        n_threads=threads, n_threads_batch=threads, use_mmap=opts.get("mmap", True),
        use_mlock=opts.get("mlock", False), logits_all=False, verbose=False,
    )
    # use_extra_bufts (the CPU backend's repacked weight buffers) is llama.cpp's default and stays so unless the arm
    # asks for repacking off (extra_bufts False: `--no-extra-bufts`, or the bench's fallback after the defaults
    # crashed, e.g. a SIGILL on an AMX path). Llama() takes no argument for it: it is set in the defaults it starts
    # from.
    extra_bufts = opts.get("extra_bufts")
    defaults = llama_cpp.llama_cpp.llama_model_default_params
    llama_cpp.llama_cpp.llama_model_default_params = with_extra_bufts(defaults, extra_bufts)
    try:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(**params)
        load_s = time.perf_counter() - t0
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = defaults
    advised = madvise_file_mappings(opts["gguf"], opts["madvise"]) if opts.get("madvise") else 0
    n_vocab = llm.n_vocab()

    def argmax() -> int:  # logits llama.cpp computed for the last evaluated position
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        return int(np.argmax(logits))

    steps = Steps(warmup)
    before = counters()
    t0 = time.perf_counter()
    llm.eval(prompt)
    out = [argmax()]
    prefill_s = time.perf_counter() - t0
    steps.mark()
    prefill_disk = steps.marks[0]["disk_read_bytes"] - before["disk_read_bytes"]
    prefill_faults = steps.marks[0]["major_faults"] - before["major_faults"]
    for tok in tokens:
        t0 = time.perf_counter()
        llm.eval([tok])
        out.append(argmax())
        steps.step_s.append(time.perf_counter() - t0)
        steps.mark()
    settings = {k: v for k, v in params.items() if k != "model_path"}
    settings.update(gguf=opts["gguf"], madvise=opts.get("madvise"), madvised_bytes=advised,
                    use_extra_bufts=getattr(llm.model_params, "use_extra_bufts", "not in this llama.cpp"),
                    repacking="llama.cpp's default" if extra_bufts is None else "off (use_extra_bufts=False)",
                    system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip())
    if hasattr(llm, "close"):  # frees the model and context now, not at interpreter exit
        llm.close()
    return {"argmax": out, "load_s": load_s, "prefill_s": prefill_s, "prefill_tokens": len(prompt),
            "prefill_disk_read_bytes": prefill_disk,
            "prefill_major_faults": prefill_faults, **steps.record(),
            "peer": {"kind": "llama.cpp", "version": llama_cpp.__version__, "settings": settings}}


def _cache_of(output: Any, name: str) -> Any:
    cache = getattr(output, name, None)
    return output.past_key_values if cache is None else cache


# -- transformers + accelerate ---------------------------------------------------------------------------------------
def replay_accelerate(model: str, opts: dict[str, Any], prompt: list[int], tokens: list[int],
                      warmup: int) -> dict[str, Any]:
    import accelerate
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    dtype = opts.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "float32"
    own_folder = not opts.get("offload_folder")
    offload = opts.get("offload_folder") or tempfile.mkdtemp(prefix="sluice-peer-offload-")
    try:
        t0 = time.perf_counter()
        lm = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype), device_map="auto",
            max_memory={"cpu": parse_size(opts.get("max_memory", "256MiB"))}, offload_folder=offload)
        lm.eval()
        load_s = time.perf_counter() - t0
        # Loading read the checkpoint and (MoE experts are fused at load) re-saved the offloaded weights: drop both
        # from the page cache so the replay starts as cold as every other arm's.
        written = []
        for root, _, files in os.walk(offload):
            written += [os.path.join(root, n) for n in files]
        for path in written + [os.path.join(model, n) for n in os.listdir(model)]:
            if os.path.isfile(path):
                evict(path)
        device_map = getattr(lm, "hf_device_map", {}) or {}
        placed: dict[str, int] = {}
        for dev in device_map.values():
            placed[str(dev)] = placed.get(str(dev), 0) + 1

        # transformers >= 5.2x names the KV cache argument `cache` (past_key_values is deprecated)
        cache_kw = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
        steps = Steps(warmup)
        with torch.inference_mode():
            before = counters()
            t0 = time.perf_counter()
            o = lm(input_ids=torch.tensor([prompt]), use_cache=True)
            past = _cache_of(o, cache_kw)
            out = [int(o.logits[0, -1].argmax())]
            prefill_s = time.perf_counter() - t0
            steps.mark()
            prefill_disk = steps.marks[0]["disk_read_bytes"] - before["disk_read_bytes"]
            prefill_faults = steps.marks[0]["major_faults"] - before["major_faults"]
            for tok in tokens:
                t0 = time.perf_counter()
                o = lm(input_ids=torch.tensor([[tok]]), use_cache=True, **{cache_kw: past})
                past = _cache_of(o, cache_kw)
                out.append(int(o.logits[0, -1].argmax()))
                steps.step_s.append(time.perf_counter() - t0)
                steps.mark()
        offload_bytes = sum(os.path.getsize(p) for p in written if os.path.isfile(p))
    finally:
        if own_folder:
            shutil.rmtree(offload, ignore_errors=True)
    settings = {"device_map": "auto", "max_memory_cpu": opts.get("max_memory", "256MiB"), "dtype": dtype,
                "offload_folder": "temporary" if own_folder else offload, "offload_files_written": len(written),
                "offload_bytes_written": offload_bytes, "modules_by_device": placed,
                "evicted_after_load": True, "threads": torch.get_num_threads()}
    return {"argmax": out, "load_s": load_s, "prefill_s": prefill_s, "prefill_tokens": len(prompt),
            "prefill_disk_read_bytes": prefill_disk,
            "prefill_major_faults": prefill_faults, **steps.record(),
            "peer": {"kind": "accelerate", "version": f"transformers {transformers.__version__}, accelerate "
                     f"{accelerate.__version__}, torch {torch.__version__}", "settings": settings}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peer_child.py", description=__doc__)
    p.add_argument("mode", choices=["replay"])
    p.add_argument("--peer", required=True, choices=["llama.cpp", "accelerate"])
    p.add_argument("--model", required=True)
    p.add_argument("--options", default="{}", help="the peer's options as JSON")
    p.add_argument("--work", required=True, help="JSON file holding prompt_ids and tokens")
    p.add_argument("--warmup", type=int, default=0, help="untimed decode steps first")
    a = p.parse_args(argv)
    opts = json.loads(a.options)
    with open(a.work) as f:
        work = json.load(f)
    prompt, tokens = list(work["prompt_ids"]), list(work["tokens"])
    if a.warmup >= len(tokens):
        print(json.dumps({"ok": False, "error": f"{len(tokens)} tokens leave no timed step after {a.warmup} warm-up"}))
        return 2
    try:
        if a.peer == "llama.cpp":
            rec = replay_llama_cpp(opts, prompt, tokens, a.warmup)
        else:
            rec = replay_accelerate(a.model, opts, prompt, tokens, a.warmup)
    except (OSError, ValueError, ImportError) as e:  # a missing file, a bad option, a peer not installed
        traceback.print_exc()
        print(json.dumps({"ok": False, "error": f"{a.peer}: {type(e).__name__}: {e}"}), flush=True)
        return 2
    mem = memory_status()
    rec.update(ok=True, peak_rss_bytes=mem.get("peak_rss_bytes", 0), stats=mem)
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
