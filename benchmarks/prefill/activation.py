"""Peak RSS growth per prefill token (the per-token activation figure of store/budget.py): one forward pass of T
prompt tokens in one chunk, resident, after a warm-up pass; the growth is the peak resident set (VmHWM, reset with
/proc/self/clear_refs after the warm-up) minus the resident set before the pass. Run one process per T (freed
activations stay in the allocator's heap, so a second pass in the same process would grow less), then take the
slope between two T:

    PYTHONPATH=. .venv/bin/python benchmarks/prefill/activation.py [MODEL] --tokens 512
    PYTHONPATH=. .venv/bin/python benchmarks/prefill/activation.py [MODEL] --tokens 2048
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import sluice


def _status(key: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    ids = torch.randint(0, 30000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with sluice.load(a.model, memory="all", prefill_chunk=a.tokens, max_context=a.tokens + 16) as m:
        m.replay(ids[:64], [])  # warm-up: kernels, scratch buffers, thread pools
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        m.replay(ids, [])
        grown = _status("VmHWM") - before
    print(f"{a.tokens} tokens in one chunk: peak RSS +{grown / 2**20:.1f} MiB = {grown / a.tokens / 1024:.1f} KiB "
          f"a token")


if __name__ == "__main__":
    main()
