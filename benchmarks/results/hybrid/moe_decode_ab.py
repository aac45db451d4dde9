"""In-process A/B of a decode token's MoE block in two native calls a layer (models/layers/moe_decode.py MoEDecode)
against the one-token path of models/layers/moe.py it replaces (the same bits: the same C functions): one model,
its greedy stream after [5, 6] (40 tokens skipped), each round 16 timed tokens with every layer's MoEDecode on, 16
with it off (one untimed token after each switch), arm order rotated per round (benchmarks/common.py
alternate_tokens). MODE as benchmarks/common.py decode_options (resident, stream, router, auto).

    .venv/bin/python benchmarks/results/hybrid/moe_decode_ab.py MODE ROUNDS [MODEL]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import HYBRID_Q4, alternate_tokens, decode_stream, print_paired

mode, rounds = sys.argv[1], int(sys.argv[2])
m, it = decode_stream(sys.argv[3] if len(sys.argv) > 3 else HYBRID_Q4, mode)
blocks = [(layer.ffn, layer.ffn.decode) for layer in m.model.layers if getattr(layer.ffn, "decode", None) is not None]
print(f"{len(blocks)} layers with MoEDecode")


def switch(on: bool):
    def go():
        for ffn, dec in blocks:
            ffn.decode = dec if on else None
    return go


res = alternate_tokens(it, {"moe.py": switch(False), "MoEDecode": switch(True)}, rounds)
print_paired(res, "moe.py", "MoEDecode", mode + " {arm}", "MoEDecode")
it.close()
m.close()
