"""The native quantized-expert kernels (sluice/quant/native: kernels.c the float path, q8.c the integer path), built
at install time.

`optional=True`: a machine without a C compiler still installs sluice; sluice.quant.native then reports
native_available() False and the torch kernels run instead. -ffp-contract=off keeps every dequantized weight the
reference's value (no fused multiply-add between a scale product and its bias); the AVX2 path is selected per
function with target attributes and at run time, so the build needs no -march flag and runs on any x86-64 / aarch64.
"""

from setuptools import Extension, setup

NATIVE = "sluice/quant/native/"
SOURCES = [NATIVE + name for name in ("kernels.c", "q8.c", "pool.c", "ops.c", "decode.c", "prompt.c", "attend.c",
                                      "deltanet.c", "delta_prompt.c")]
setup(ext_modules=[Extension("sluice.quant.native._kernels", SOURCES,
                             depends=[NATIVE + "common.h", NATIVE + "deltanet.h", NATIVE + "fp8.h"], libraries=["m", "pthread"],
                             extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"],
                             optional=True)])
