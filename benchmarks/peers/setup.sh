#!/usr/bin/env bash
# The peers' benchmark environment, never used by CI: benchmarks/peers/.venv (gitignored) holding
#   llama-cpp-python  built from source (~8 min on 2 cores; CMake picks the host's CPU features, GGML_NATIVE)
#   transformers + accelerate, with torch pinned to 2.13.0 from PyTorch's CPU index (PyPI's wheel pulls several GB of
#   CUDA libraries; TORCH_INDEX overrides the index, TORCH_INDEX= leaves it to pip's configuration, as in the Makefile,
#   whose comment says why --index-url and the short retries)
#   llama.cpp/ (gitignored): llama.cpp's converter from the same sdist (the tests run it: tests/checkpoint/llama_cpp.py)
# `sluice bench --peer-python benchmarks/peers/.venv/bin/python` runs the `peer:` arms with this interpreter.
#
#   bash benchmarks/peers/setup.sh          # idempotent: an existing, complete venv is only checked
#   AVX2=1 bash benchmarks/peers/setup.sh   # benchmarks/peers/.venv-avx2: llama.cpp built for an AVX2-only CPU
#                                           # (GGML_NATIVE=OFF, AVX2 + FMA + F16C, no AVX-512 / AVX-VNNI / AMX), to
#                                           # measure the AVX2 path on an AVX-512 machine beside `sluice --isa avx2`
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
if [ -n "${AVX2:-}" ]; then
  VENV=.venv-avx2
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
PY=${PYTHON:-python3}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
TRANSFORMERS=${TRANSFORMERS:-5.24.0}  # the version sluice's parity tests use
ACCELERATE=${ACCELERATE:-1.15.0}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"  # every later install keeps it

TORCH_PIP=()
[ -z "$TORCH_INDEX" ] || TORCH_PIP=(--index-url "$TORCH_INDEX" --retries 0 --timeout 15)
"${PIP[@]}" "${TORCH_PIP[@]}" -c "$CONSTRAINTS" "torch==2.13.0"
"${PIP[@]}" -c "$CONSTRAINTS" "transformers==$TRANSFORMERS" "accelerate==$ACCELERATE" safetensors numpy

if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  # From source, on purpose: the wheel is built for this CPU (AVX2=1: for CMAKE_ARGS). nice: the machine is shared.
  # --no-cache-dir: pip's wheel cache would hand the second venv the first one's build (found 2026-12-03: .venv-avx2
  # held .venv's AVX-512 / AMX library, byte for byte, so every AVX2 llama.cpp arm before then ran AVX-512 code)
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice -n 19 "${PIP[@]}" -c "$CONSTRAINTS" --no-cache-dir \
    --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON"
fi
if [ -n "${AVX2:-}" ] && "$VENV/bin/python" -c "import llama_cpp, sys
sys.exit('AVX512 = 1' not in llama_cpp.llama_print_system_info().decode())"; then
  echo "$VENV: llama.cpp reports AVX-512 code (llama_print_system_info); remove $VENV and run AVX2=1 again" >&2
  exit 1
fi

# llama.cpp's converter (convert_hf_to_gguf.py + conversion/ + gguf-py/, as the hub's GGUFs are made) from the same
# sdist, for the tests that convert checkpoints with it (tests/checkpoint/llama_cpp.py); shared by both venvs
SRC=llama.cpp
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
  SDIST=$(mktemp -d)
  "$VENV/bin/python" -m pip download --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$SDIST"
  tar -xzf "$SDIST"/llama_cpp_python-*.tar.gz -C "$SDIST"
  mkdir -p "$SRC"
  cp -r "$SDIST"/llama_cpp_python-*/vendor/llama.cpp/{convert_hf_to_gguf.py,conversion,gguf-py} "$SRC"/
  rm -rf "$SDIST"
fi

"$VENV/bin/python" - <<'PY'
import accelerate, llama_cpp, torch, transformers
print(f"peers venv ok: llama-cpp-python {llama_cpp.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, torch {torch.__version__}")
PY
