"""torch's profiler over one resident 2,048-token prompt of the peers Q4_K_M file (after one untimed), capped at AVX2:
the torch ops a prompt still runs and their self CPU time (native calls appear as the time between them).

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python benchmarks/quantized/prompt_profile.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import sluice  # before torch: torch's OpenMP workers must not spin (sluice/__init__.py)
import torch

MODEL = Path(__file__).resolve().parents[1] / "models/qwen3_moe-peers/model-Q4_K_M.gguf"


def main() -> None:
    from torch.profiler import profile

    torch.set_num_threads(2)
    m = sluice.load(MODEL, memory="all", prefill_chunk=2048, isa="avx2")
    ids = torch.randint(0, 30000, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
    m.forget_cache()
    list(m.generate_tokens(ids, max_tokens=1, stop_at_eos=False))
    m.forget_cache()
    with profile(record_shapes=True) as p:
        list(m.generate_tokens(ids, max_tokens=1, stop_at_eos=False))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=44))
    print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=8,
                                                           max_name_column_width=32, max_shapes_column_width=56))


if __name__ == "__main__":
    sys.exit(main())
