"""Peak memory of a Gated DeltaNet layer's prompt steps (models/layers/gated_deltanet.py `_steps`: the conv, the delta
rule, the gated norm) over one DELTA_SLICE of 256 tokens at Qwen3.5 / 3.6's linear-attention shapes (16 key heads,
32 value heads tiled, 128 x 128, conv of 4 taps; bf16), the rule native (native/delta_prompt.py) or torch's
(delta_rule.chunked): each arm in a fresh process, after a 2-token warm-up, the growth of peak RSS (VmHWM after
/proc/self/clear_refs) over the slice, in KiB a token, against models/spec.py DeltaNetSpec.prompt_bytes_per_token
(store/budget.py reserves ALLOCATOR_FACTOR times it a slice). Output: delta_prompt_memory.txt.

    .venv/bin/python benchmarks/results/hybrid/delta_prompt_memory.py
"""

import subprocess
import sys
import types

import sluice  # noqa: F401  before torch, as the engine
import torch
import torch.nn.functional as F

from sluice.models.layers import delta_rule
from sluice.models.layers.gated_deltanet import GatedDeltaNet
from sluice.models.spec import DELTA_SLICE, DeltaNetSpec
from sluice.quant.native.delta_prompt import DeltaRulePrompt

SPEC = DeltaNetSpec(layers=[True], n_k_heads=16, n_v_heads=32, k_head_dim=128, v_head_dim=128, conv_kernel=4,
                    tiled=True)
DTYPE = torch.bfloat16


def _layer(native: bool):
    """The attributes _steps reads, as GatedDeltaNet.__init__ sets them, on random weights and a zero state."""
    d, C = SPEC, SPEC.conv_dim
    rule = DeltaRulePrompt(d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim, DTYPE, tiled=True) if native else None
    w = types.SimpleNamespace(conv=torch.randn(C, 1, d.conv_kernel).to(DTYPE), dt_bias=torch.randn(d.n_v_heads),
                              norm=torch.ones(d.v_head_dim, dtype=DTYPE))
    cache = types.SimpleNamespace(conv=torch.zeros(C, d.conv_kernel - 1, dtype=DTYPE),
                                  recurrent=torch.zeros(d.n_v_heads, d.k_head_dim, d.v_head_dim))
    layer = types.SimpleNamespace(d=d, w=w, cache=cache, act=F.silu, r=d.n_v_heads // d.n_k_heads, tiled=True,
                                  neg_A=-torch.rand(d.n_v_heads), eps=1e-6, gate_act=F.silu, native_prompt=rule, native_conv=native,
                                  prompt_rule=rule or delta_rule.chunked, decode_rule=delta_rule.recurrent)
    layer._conv = types.MethodType(GatedDeltaNet._conv, layer)
    return layer


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))  # KiB


def _arm(native: bool) -> float:
    """KiB of peak RSS growth a token over one slice (this process)."""
    torch.set_num_threads(2)
    layer = _layer(native)
    inputs = lambda T: (torch.randn(T, SPEC.conv_dim).to(DTYPE), torch.randn(T, SPEC.value_dim).to(DTYPE),  # noqa
                        torch.randn(T, SPEC.n_v_heads).to(DTYPE), torch.randn(T, SPEC.n_v_heads).to(DTYPE))
    GatedDeltaNet._steps(layer, *inputs(2))
    x = inputs(DELTA_SLICE)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS:")
    GatedDeltaNet._steps(layer, *x)
    return (_status("VmHWM:") - before) / DELTA_SLICE


def main():
    if len(sys.argv) > 1:
        print(_arm(sys.argv[1] == "native"))
        return
    run = lambda arm: float(subprocess.run([sys.executable, __file__, arm], capture_output=True, text=True,  # noqa
                                           check=True).stdout)
    got = {arm: [run(arm) for _ in range(3)] for arm in ("native", "torch")}
    for arm, kib in got.items():
        print(f"{arm:>6}: peak RSS growth over a {DELTA_SLICE}-token slice: {min(kib):.1f} KiB a token "
              f"(3 fresh processes: {[round(k, 1) for k in kib]})")
    print(f"DeltaNetSpec.prompt_bytes_per_token(2): {SPEC.prompt_bytes_per_token(2) / 1024:.1f} KiB a token")


if __name__ == "__main__":
    main()
