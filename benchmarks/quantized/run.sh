#!/usr/bin/env bash
# Quantized experts against llama.cpp on the same Q4_K_M file (issue 14): every arm reads the same GGUF bytes, cold
# (verified), in a fresh process inside a memory cgroup (page cache included), replaying the same tokens, rotated,
# paired medians, step time against the I/O floor measured in the same run (sluice's own reads replayed cold with its
# reader before the first round and after the last). The Q4_K_M files are made by llama.cpp's own quantizer
# from `sluice export-gguf`'s bf16 GGUF (`benchmarks/quality.py quantize`, in the peers venv).
#
# llama.cpp runs three ways in every set (issue 33): its defaults (repacked CPU buffers on; `sluice bench` falls back
# to repacking off by itself, and says so, where the defaults crash on this CPU), repacking off (`--no-extra-bufts`),
# and MADV_RANDOM over its mapping (defaults otherwise); each wins somewhere, and each results.md names the best.
#
#   peers   the 3.4 GB bf16 synthetic qwen3_moe of benchmarks/peers (16 layers, 64 experts top-8, expert
#           intermediate 512): its Q4_K_M file is 1.05 GB, about the size of memory at a 1 GiB ceiling: the issue-8
#           table's rows for a user holding the Q4_K_M file (transformers + accelerate cannot offload from a GGUF:
#           it has no row here); sluice also with --prefetch router (benchmarks/prefetch_router.sh)
#   6GiB    a ~6 GiB bf16 synthetic qwen3_moe with expert intermediate 512 (multiples of 256, as real models'):
#           Q4_K_M ~1.8 GB, which does not fit at 1 GiB; also sluice with --activations int8
#   resident  the peers Q4_K_M file with no ceiling, warm: decode speed with everything in memory, same threads;
#             also sluice with --activations int8 (llama.cpp's own activation coding, Q8_K / Q8_0)
#   bf16    sluice on the peers model's bf16 folder at 1 GiB: the bytes and time quantization saves
#   fits    the peers Q4_K_M file at a 1.5 GiB ceiling, where it about fits: sluice's defaults (--memory auto)
#           and a 1 GiB budget against llama.cpp's three arms
#   lowbit  issue 32's resident rows: the peers model quantized by llama.cpp to Q2_K, IQ4_XS and IQ2_XXS (with an
#           importance matrix: LOWBIT="..." picks the types), no ceiling, warm, same threads, sluice (defaults,
#           and the activation coding auto did not pick) against the three llama.cpp arms; one folder per type
#           (resident-<type>)
#
#   prompt  issue 33's prompt row: the peers Q4_K_M file at a 1 GiB ceiling, cold, a 2,048-token prompt, sluice's
#           default options (--memory auto, --io direct) against llama.cpp's three arms (prompt tok/s)
#   chunks  the same prompt and 8 decode steps after it, sluice alone: --memory auto's own 256-token passes against
#           --prefill-chunk 1024 / 2048 and --memory 512MiB (bigger passes, fewer expert slots for the decode)
#
#   bash benchmarks/quantized/run.sh              # ROUNDS=3 STEPS=8 WARMUP=2; SETS="peers 6GiB resident bf16"
#   ISA=avx2 bash benchmarks/quantized/run.sh     # the AVX2 path on an AVX-512 machine: sluice --isa avx2, torch with
#                                                 # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (and MKL's float32
#                                                 # GEMM, which ignores both: MKL_ENABLE_INSTRUCTIONS=AVX2), llama.cpp
#                                                 # built for AVX2 (peers/setup.sh AVX2=1); results in <set>-avx2
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-8}; WARMUP=${WARMUP:-2}
SETS=${SETS:-peers 6GiB resident bf16}
OUT=${OUT:-benchmarks/results/quantized}
PEER_PY=benchmarks/peers/.venv/bin/python
QUANT=(nice -n 19 "$PEER_PY" benchmarks/quality.py quantize)
[ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp" 2>/dev/null || bash benchmarks/peers/setup.sh
WANT_ISA=${ISA:-auto}; ISA=(); TAG=""
if [ "$WANT_ISA" = avx2 ]; then  # the quantizer above stays the native build's; the arms take the AVX2 one
  ISA=(--isa avx2); TAG="-avx2"; PEER_PY=benchmarks/peers/.venv-avx2/bin/python
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  [ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp" 2>/dev/null || AVX2=1 bash benchmarks/peers/setup.sh
fi
SLUICE=(nice -n 19 .venv/bin/sluice)

model() {  # model DIR make-model-args...: the bf16 folder, its bf16 GGUF and llama.cpp's Q4_K_M of it
  local dir=$1; shift
  [ -f "$dir/config.json" ] || "${SLUICE[@]}" make-model "$dir" --arch qwen3_moe "$@"
  [ -f "$dir/model.gguf" ] || "${SLUICE[@]}" export-gguf "$dir" "$dir/model.gguf" --dtype bf16
  [ -f "$dir/model-Q4_K_M.gguf" ] || "${QUANT[@]}" "$dir/model.gguf" "$dir/model-Q4_K_M.gguf" Q4_K_M
}
quant() {  # quant DIR TYPE: llama.cpp's TYPE of DIR's bf16 GGUF; the IQ1 / IQ2 types with an importance matrix of
           # the model's own activations (benchmarks/imatrix.py, 32 windows of the demo corpus' training text)
  [ -f "$1/model-$2.gguf" ] && return
  case $2 in
    IQ1_*|IQ2_*)
      [ -f "$1/model.imatrix" ] || nice -n 19 .venv/bin/python benchmarks/quality.py imatrix "$1/model.imatrix" \
        --model "$1" --chunks 32
      "${QUANT[@]}" "$1/model.gguf" "$1/model-$2.gguf" "$2" --imatrix "$1/model.imatrix" ;;
    *) "${QUANT[@]}" "$1/model.gguf" "$1/model-$2.gguf" "$2" ;;
  esac
}
PEERS=benchmarks/models/qwen3_moe-peers
SIX=benchmarks/models/qwen3_moe-6GiB-i512
model "$PEERS" --size 3.4GB --layers 16 --experts 64 --top-k 8 --expert-intermediate 512

# llama.cpp-norepack+random: repacking off with MADV_RANDOM, llama.cpp's best arm under a ceiling where it was run
# (benchmarks/hybrid/run.sh, 2026-12-05); +random alone keeps repacking wherever the defaults run
LLAMA=(--arm llama.cpp="peer:llama.cpp" --arm llama.cpp-norepack="peer:llama.cpp --no-extra-bufts"
       --arm llama.cpp+random="peer:llama.cpp --madvise random"
       --arm llama.cpp-norepack+random="peer:llama.cpp --no-extra-bufts --madvise random")
bench() {  # bench MODEL OUTDIR bench-args...: sluice's arms ("--arm name=FLAGS", not peer:) get ISA's flags
  local m=$1 dir=$2$TAG; shift 2
  local args=() a
  for a in "$@"; do
    case $a in sluice*=*) args+=("$a ${ISA[*]}") ;; *) args+=("$a") ;; esac
  done
  echo "== $m -> $dir ($(date -u +%H:%M:%S))"
  "${SLUICE[@]}" bench "$m" --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" --prompt-tokens 32 \
    --peer-python "$PEER_PY" --out "$dir" "${args[@]}"
}
resident() {  # resident GGUF OUTDIR CODING: no ceiling, warm, 2 threads each, sluice's defaults and its activations
             # coded as CODING (the one auto did not pick) against llama.cpp's arms
  bench "$1" "$2" --warm \
    --arm sluice="--memory all --threads 2" --arm llama.cpp="peer:llama.cpp --threads 2" \
    --arm llama.cpp-norepack="peer:llama.cpp --threads 2 --no-extra-bufts" \
    --arm llama.cpp+random="peer:llama.cpp --threads 2 --madvise random" \
    --arm sluice-$3="--memory all --threads 2 --activations $3"
}
for set in $SETS; do
  case $set in
    peers)
      for setting in 1GiB:640MiB 1536MiB:1GiB; do
        C=${setting%%:*}; M=${setting##*:}
        bench "$PEERS/model-Q4_K_M.gguf" "$OUT/peers-$C" --cold --ceiling "$C" \
          --arm sluice="--io direct --memory $M" "${LLAMA[@]}" \
          --arm sluice+router="--io direct --memory $M --prefetch router"
      done ;;
    6GiB)
      model "$SIX" --size 6GiB --expert-intermediate 512
      bench "$SIX/model-Q4_K_M.gguf" "$OUT/6GiB-1GiB" --cold --ceiling 1GiB \
        --arm sluice="--io direct --memory 640MiB" "${LLAMA[@]}" \
        --arm sluice-int8="--io direct --memory 640MiB --activations int8" ;;
    resident)
      resident "$PEERS/model-Q4_K_M.gguf" "$OUT/resident" int16 ;;
    lowbit)
      for t in ${LOWBIT:-Q2_K IQ4_XS IQ2_XXS}; do  # --activations auto: int8 under 5.5 bits a weight (Q2_K 2.9,
        quant "$PEERS" "$t"                        # IQ4_XS 4.3, IQ2_XXS)
        resident "$PEERS/model-$t.gguf" "$OUT/resident-$t" int16
      done ;;
    bf16)
      bench "$PEERS" "$OUT/bf16-1GiB" --cold --ceiling 1GiB --arm sluice-bf16="--io direct --memory 640MiB" ;;
    fits)  # the file about fits (issue 33): sluice's defaults (--memory auto) against a 1 GiB budget, 1.5 GiB ceiling
      bench "$PEERS/model-Q4_K_M.gguf" "$OUT/fits-1536MiB" --cold --ceiling 1536MiB --arm sluice="--io direct" \
        --arm sluice-1GiB="--io direct --memory 1GiB" "${LLAMA[@]}" ;;
    prompt)
      bench "$PEERS/model-Q4_K_M.gguf" "$OUT/prompt-1GiB" --cold --ceiling 1GiB --steps 1 --warmup 0 \
        --prompt-tokens 2048 --arm sluice="--io direct" "${LLAMA[@]}" ;;
    chunks)  # the prompt's passes against the decode's slots at 1 GiB: --memory auto with its own chunk (256 tokens
             # there), with --prefill-chunk 1024 / 2048 (their activations out of auto's budget), and --memory 512MiB
      bench "$PEERS/model-Q4_K_M.gguf" "$OUT/chunks-1GiB" --cold --ceiling 1GiB --steps 8 --warmup 2 \
        --prompt-tokens 2048 --arm auto="--io direct" --arm chunk1024="--io direct --prefill-chunk 1024" \
        --arm chunk2048="--io direct --prefill-chunk 2048" --arm m512="--io direct --memory 512MiB" ;;
    *) echo "SETS: unknown set '$set' (peers 6GiB resident bf16 fits lowbit prompt chunks)" >&2; exit 2 ;;
  esac
done
