"""Quantize a GGUF with llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize): the K-quant files
users download are made this way. Runs in the peers venv (benchmarks/peers/setup.sh), never in CI.

    benchmarks/peers/.venv/bin/python benchmarks/quantized/quantize_llamacpp.py IN.gguf OUT.gguf Q4_K_M
"""

import os
import sys

import llama_cpp


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst, kind = sys.argv[1:]
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        print(f"error: unknown type {kind!r} (e.g. Q4_K_M, Q5_K_M, Q8_0, Q4_0)", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    tmp = dst + ".partial"
    rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
    if rc != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    os.replace(tmp, dst)
    print(f"{dst}: {os.path.getsize(dst) / 1e9:.2f} GB ({kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
