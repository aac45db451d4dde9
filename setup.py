"""The native quantized-expert kernels (sluice/quant/native: kernels.c the float path, q8.c the integer path), the
direct reader's C workers (sluice/io/preader.c, uring.c) and its planner (plan.c), the streaming store's slot
table (sluice/store/slots.c) and the router's tie order (sluice/quant/native/topk.cc, C++), built at install time.

`optional=True`: a machine without a C compiler still installs sluice; sluice.quant.native then reports
native_available() False and the torch kernels run instead. -ffp-contract=off keeps every dequantized weight the
reference's value (no fused multiply-add between a scale product and its bias); the AVX2 path is selected per
function with target attributes and at run time, so the build needs no -march flag and runs on any x86-64 / aarch64.
"""

from setuptools import Extension, setup

NATIVE = "sluice/quant/native/"
SOURCES = [NATIVE + name for name in ("kernels.c", "q8.c", "pool.c", "ops.c", "decode.c", "prompt.c", "prompt_avx2.c",
                                      "prompt_q5k.c", "prompt_q6k.c", "attend.c", "attend_avx2.c", "deltanet.c", "delta_prompt.c", "lowbit.c", "q8_low.c", "layer.c",
                                      "moe_decode.c")]
HEADERS = ("common.h", "deltanet.h", "prompt.h", "q8.h", "lowbit.h", "iq_grids.h", "q8_iq.h", "fp8.h", "topk.h")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"]
setup(ext_modules=[Extension("sluice.quant.native._kernels", SOURCES, depends=[NATIVE + h for h in HEADERS],
                             libraries=["m", "pthread"], extra_compile_args=FLAGS, optional=True),
                   # the direct reader's C workers (io/native_pool.py); without it the Python workers read
                   Extension("sluice.io._preader", ["sluice/io/preader.c", "sluice/io/uring.c", "sluice/io/plan.c"],
                             depends=["sluice/io/preader.h"], libraries=["pthread"], extra_compile_args=FLAGS,
                             optional=True),
                   # the streaming store's slot table and eviction policy (store/slot_table.py); without it, Python's
                   Extension("sluice.store._slots", ["sluice/store/slots.c", "sluice/store/stream.c"],
                             depends=["sluice/store/slots.h"], extra_compile_args=FLAGS,
                             optional=True),
                   # torch.topk's tie order for the decode router (quant/native/topk.cc: the C++ standard library's
                   # algorithms, so it needs a C++ compiler; without one, ties go to torch.topk); header templates
                   # only, no exceptions or RTTI: it calls nothing in the C++ runtime library
                   Extension("sluice.quant.native._topk", [NATIVE + "topk.cc"], depends=[NATIVE + "topk.h"],
                             extra_compile_args=["-O3", "-std=c++11", "-fno-exceptions", "-fno-rtti"], language="c++",
                             optional=True)])
