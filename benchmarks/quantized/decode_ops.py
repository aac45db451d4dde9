"""Torch ops per forward pass of a resident GGUF (every aten op dispatched, counted with a TorchDispatchMode) over a
one-token prompt and two decode steps, most frequent first: what the native calls of a decode step replace.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/decode_ops.py [GGUF] [--top 20]
"""

from __future__ import annotations

import argparse
import collections

from torch.utils._python_dispatch import TorchDispatchMode

import sluice


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    with sluice.load(a.model, memory="all") as m:
        m.replay([100], [200, 201, 202])  # warm-up
        c = Count()
        with c:
            m.replay([100], [200, 201])  # three forward passes: the prompt token and two decode steps
    print(f"{sum(c.ops.values()) / 3:.0f} torch ops per forward pass")
    for name, n in c.ops.most_common(a.top):
        print(f"{n / 3:6.1f}  {name}")


if __name__ == "__main__":
    main()
