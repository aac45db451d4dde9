"""A decode layer's expert call on cold memory, the task length and the page size it runs with (q8.c task_rows,
store/pages.py): expert_layer.c on the peers Q4_K_M file's own expert bytes (layer 3's gate, layer 0's Q6_K down),
2 threads then 1, three times each.

    .venv/bin/python benchmarks/quantized/expert_layer.py > benchmarks/results/quantized/breakdown/expert-layer.txt

Arms: task spread 4 (the default: one task per projection at this size on 2 threads) or 1<<30 (64K-weight tasks,
as before), huge pages on or off.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL = HERE.parents[0] / "models/qwen3_moe-peers/model-Q4_K_M.gguf"


def main() -> None:
    from gguf import GGUFReader

    import sluice.quant.native._lib as lib
    from sluice.host.cpus import cpu_line, describe_cpu

    print("CPU", cpu_line(describe_cpu()))
    tensors = {t.name: t for t in GGUFReader(MODEL).tensors}
    with tempfile.TemporaryDirectory() as d:
        gate, down = Path(d) / "gate.bin", Path(d) / "down.bin"
        for path, name, kind in ((gate, "blk.3.ffn_gate_exps.weight", 12), (down, "blk.0.ffn_down_exps.weight", 14)):
            t = tensors[name]
            assert int(t.tensor_type) == kind, f"{name}: type {t.tensor_type}"
            np.array(t.data).reshape(-1).view(np.uint8).tofile(path)
        exe = Path(d) / "expert_layer"
        subprocess.run(["gcc", "-O2", "-o", exe, HERE / "expert_layer.c", "-ldl"], check=True)
        so = Path(lib.__file__).with_name(next(p.name for p in Path(lib.__file__).parent.glob("_kernels*.so")))
        for spread, huge in (("4", "1"), ("1073741824", "1"), ("4", "0"), ("1073741824", "0")):
            out = subprocess.run([exe, so, gate, down, spread, huge], check=True, capture_output=True, text=True)
            print(out.stdout, end="", flush=True)


if __name__ == "__main__":
    sys.exit(main())
