#!/usr/bin/env bash
# Streamed prefill (issue 15): a 2,048-token prompt under a memory ceiling the model does not fit, cold (verified),
# sluice against llama.cpp's prompt processing (mmap, its default n_batch 512) on the same GGUF, run three ways (its
# defaults, repacked CPU buffers on unless they crash on this CPU; repacking off, `--no-extra-bufts`; MADV_RANDOM;
# `benchmarks/tables.py prefill` compares with the best of them), in `sluice bench`
# (fresh process per run, rotated arms, paired medians; prefill tok/s and prefill read columns); then the same prompt
# resident and warm (the compute time), and `tables.py prefill`'s verdicts: bytes read vs the touched experts' bytes,
# streamed time vs max(compute, prompt floor: sluice's own prompt reads replayed cold in the same run, before and
# after the rounds), sluice vs llama.cpp.
#
#   bash benchmarks/prefill/run.sh        # ROUNDS=3 PROMPT=2048 CEILING=1GiB MEMORY=640MiB SETS="q4km bf16"
#   ISA=avx2 bash benchmarks/prefill/run.sh        # the AVX2 path on an AVX-512 machine: sluice --isa avx2, torch with
#                                                  # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 and its MKL with
#                                                  # MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's float32 GEMM ignores the
#                                                  # other two and ran AVX-512 code before), llama.cpp built for AVX2
#                                                  # (peers/setup.sh AVX2=1); results in <set>[-act]-avx2*
#   ACTIVATIONS=int8 bash benchmarks/prefill/run.sh   # sluice's arms with --activations int8 (llama.cpp's coding of
#                                                     # x: the int8 prompt kernels); results in <set>-int8*
#
#   q4km  the peers model's Q4_K_M GGUF (1.05 GB; benchmarks/quantized/run.sh makes it)
#   bf16  the same model's bf16 GGUF (3.4 GB; sluice and llama.cpp read the same file)
#   six   the 6 GiB-class model's Q4_K_M GGUF (1.99 GB: twice the ceiling, the case sluice is for;
#         benchmarks/quantized/run.sh makes it); not in the default SETS (llama.cpp's cold prefill takes minutes)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; PROMPT=${PROMPT:-2048}; CEILING=${CEILING:-1GiB}; MEMORY=${MEMORY:-640MiB}
SETS=${SETS:-q4km bf16}
ACT=(); TAG=""
if [ -n "${ACTIVATIONS:-}" ]; then ACT=(--activations "$ACTIVATIONS"); TAG="-$ACTIVATIONS"; fi
OUT=${OUT:-benchmarks/results/prefill}
PEER_PY=benchmarks/peers/.venv/bin/python
if [ "${ISA:-auto}" = avx2 ]; then  # the AVX2 path on any x86 machine: sluice, torch and llama.cpp all capped
  ACT+=(--isa avx2); TAG="$TAG-avx2"; PEER_PY=benchmarks/peers/.venv-avx2/bin/python
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
SLUICE=(nice -n 19 .venv/bin/sluice)
PEERS=benchmarks/models/qwen3_moe-peers
[ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp" 2>/dev/null || \
  AVX2=$([ "$PEER_PY" = benchmarks/peers/.venv-avx2/bin/python ] && echo 1) bash benchmarks/peers/setup.sh
[ -f "$PEERS/model-Q4_K_M.gguf" ] || SETS=peers bash benchmarks/quantized/run.sh

bench() {  # bench MODEL OUTDIR bench-args...: one decode step after the prompt (the prefill is what is measured)
  local m=$1 dir=$2; shift 2
  echo "== $m -> $dir"
  "${SLUICE[@]}" bench "$m" --rounds "$ROUNDS" --steps 1 --warmup 0 --prompt-tokens "$PROMPT" \
    --peer-python "$PEER_PY" --out "$dir" "$@"
}
for set in $SETS; do
  case $set in
    q4km) M=$PEERS/model-Q4_K_M.gguf ;;
    bf16) M=$PEERS/model.gguf ;;
    six) M=benchmarks/models/qwen3_moe-6GiB-i512/model-Q4_K_M.gguf ;;
    *) echo "SETS: unknown set '$set' (q4km bf16 six)" >&2; exit 2 ;;
  esac
  bench "$M" "$OUT/$set$TAG-$CEILING" --cold --ceiling "$CEILING" \
    --arm sluice="--io direct --memory $MEMORY ${ACT[*]}" --arm llama.cpp="peer:llama.cpp" \
    --arm llama.cpp-norepack="peer:llama.cpp --no-extra-bufts" --arm llama.cpp+random="peer:llama.cpp --madvise random" \
    --arm llama.cpp-norepack+random="peer:llama.cpp --no-extra-bufts --madvise random"
  bench "$M" "$OUT/$set$TAG-resident" --warm --arm resident="--memory all ${ACT[*]}"
  .venv/bin/python benchmarks/tables.py prefill "$M" "$OUT/$set$TAG-$CEILING" "$OUT/$set$TAG-resident" \
    --out "$OUT/$set$TAG.md"
done
