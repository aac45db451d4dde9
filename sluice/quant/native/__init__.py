"""Native CPU kernels: C built at install time by setup.py, one thin Python wrapper per C file.

    _lib.py     the library (available(), simd()), the formats it computes (supports(spec)), the path caps
                (BEST / AVX2 / PORTABLE: every wrapper's `path` keyword, a model's Compute.path) and the argument checks
    kernels.py  kernels.c: y = x @ W^T from W's stored bytes on float32 dots; the exact dequantization
    q8.py       q8.c: the integer path (x coded to 8-bit planes, integer dots), one projection, several, an expert
    ops.py      ops.c: RMSNorm rows, rope, weighted sums of expert outputs, bitwise their torch expressions
    pool.py     pool.c: the worker threads the C calls split their rows over, the kept prompt scratch
    decode.py   decode.c: one decode token's attention core and router probabilities in one call each; topk.cc
                (C++, its own extension _topk): a router's ties in torch.topk's order
    prompt.py   prompt.c: a prompt's Q4_K projections on 8-bit codes (AVX512-VNNI), one expert in one call
    attend.py   attend.c: a prompt's causal attention in one call (AVX512_BF16)
    deltanet.py deltanet.c: one decode token of a Gated DeltaNet layer (conv, delta rule, gated norm) in one call
    delta_prompt.py delta_prompt.c: a prompt's gated delta rule (the chunked form) of one layer in one call

Without a C compiler at install the library is absent (available() False) and the torch kernels run instead; the
C code keeps no state but the pool and reads its buffers with unaligned loads, and ctypes releases the GIL while it
runs. A bad argument raises ValueError naming it.
"""

from ._lib import AVX2, BEST, FORMATS, PATHS, PORTABLE, available, simd, supports, warn_unbuilt
from .kernels import dequantize, linear
from .ops import combine_bf16, combine_rows_bf16, rms_norm_bf16, rms_norm_scaled_bf16, rope_bf16
from .pool import release_scratch, set_threads
from .q8 import ExpertCall, LinearsQ8, expert_q8, linear_q8, q8_row_bytes, q8_supported, quantize_q8

native_available = available  # the name most callers know
