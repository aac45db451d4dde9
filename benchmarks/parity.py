"""Logit parity with transformers on the tiny test checkpoints, printed per architecture, dtype and expert layout.

    .venv/bin/python benchmarks/parity.py

(tests/models/test_parity.py asserts the bounds; this prints the figures the README quotes.) fp32: sluice against
transformers. bf16: the error of sluice's bf16 run and of transformers' own bf16 run against the fp32 model the
bf16 weights were rounded from (the test allows sluice at most twice transformers' error).
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
print("| arch | dtype | layout | sluice max abs diff | transformers' bf16 error | max abs logit |\n"
      "|---|---|---|---|---|---|")
for arch in sorted(TINY):
    with torch.no_grad():
        exact = hf_model(arch, torch.float32)(ids[None]).logits[0].float()  # the fp32 reference
    for dt in (torch.float32, torch.bfloat16):
        model = hf_model(arch, dt)
        with torch.no_grad():
            ref = model(ids[None]).logits[0].float()
        own = "-" if dt == torch.float32 else f"{(ref - exact).abs().max().item():.2g}"
        for layout in ("per_expert", "fused"):
            folder = write_checkpoint(model, Path(tempfile.mkdtemp()) / arch, layout)
            with sluice.load(folder) as m:
                diff = (m.logits(ids.tolist()) - exact).abs().max().item()
            print(f"| {arch} | {str(dt)[6:]} | {layout} | {diff:.2g} | {own} | {exact.abs().max().item():.3g} |")
