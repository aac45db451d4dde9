"""Logit parity with transformers on the tiny test checkpoints, printed per architecture, dtype and expert layout.

    .venv/bin/python benchmarks/parity.py

(tests/models/test_parity.py asserts the bounds; this prints the figures the README quotes.)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import sluice  # noqa: E402
from tests.models.tiny import TINY, hf_model, write_checkpoint  # noqa: E402

ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
print("| arch | dtype | layout | max abs diff | max abs logit |\n|---|---|---|---|---|")
for arch in sorted(TINY):
    for dt in (torch.float32, torch.bfloat16):
        model = hf_model(arch, dt)
        with torch.no_grad():
            ref = model(ids[None]).logits[0].float()
        for layout in ("per_expert", "fused"):
            folder = write_checkpoint(model, Path(tempfile.mkdtemp()) / arch, layout)
            with sluice.load(folder) as m:
                diff = (m.logits(ids.tolist()) - ref).abs().max().item()
            print(f"| {arch} | {str(dt)[6:]} | {layout} | {diff:.2g} | {ref.abs().max().item():.3g} |")
