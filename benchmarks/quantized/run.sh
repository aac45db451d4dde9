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
#           it has no row here)
#   6GiB    a ~6 GiB bf16 synthetic qwen3_moe with expert intermediate 512 (multiples of 256, as real models'):
#           Q4_K_M ~1.8 GB, which does not fit at 1 GiB; also sluice with --activations int8
#   resident  the peers Q4_K_M file with no ceiling, warm: decode speed with everything in memory, same threads;
#             also sluice with --activations int8 (llama.cpp's own activation coding, Q8_K / Q8_0)
#   bf16    sluice on the peers model's bf16 folder at 1 GiB: the bytes and time quantization saves
#   fits    the peers Q4_K_M file at a 1.5 GiB ceiling, where it about fits: sluice's defaults (--memory auto)
#           and a 1 GiB budget against llama.cpp's three arms
#
#   bash benchmarks/quantized/run.sh              # ROUNDS=3 STEPS=8 WARMUP=2; SETS="peers 6GiB resident bf16"
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-8}; WARMUP=${WARMUP:-2}
SETS=${SETS:-peers 6GiB resident bf16}
OUT=${OUT:-benchmarks/results/quantized}
PEER_PY=benchmarks/peers/.venv/bin/python
SLUICE=(nice -n 19 .venv/bin/sluice)
QUANT=(nice -n 19 "$PEER_PY" benchmarks/quality.py quantize)
[ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp" 2>/dev/null || bash benchmarks/peers/setup.sh

model() {  # model DIR make-model-args...: the bf16 folder, its bf16 GGUF and llama.cpp's Q4_K_M of it
  local dir=$1; shift
  [ -f "$dir/config.json" ] || "${SLUICE[@]}" make-model "$dir" --arch qwen3_moe "$@"
  [ -f "$dir/model.gguf" ] || "${SLUICE[@]}" export-gguf "$dir" "$dir/model.gguf" --dtype bf16
  [ -f "$dir/model-Q4_K_M.gguf" ] || "${QUANT[@]}" "$dir/model.gguf" "$dir/model-Q4_K_M.gguf" Q4_K_M
}
PEERS=benchmarks/models/qwen3_moe-peers
SIX=benchmarks/models/qwen3_moe-6GiB-i512
model "$PEERS" --size 3.4GB --layers 16 --experts 64 --top-k 8 --expert-intermediate 512
model "$SIX" --size 6GiB --expert-intermediate 512

LLAMA=(--arm llama.cpp="peer:llama.cpp" --arm llama.cpp-norepack="peer:llama.cpp --no-extra-bufts"
       --arm llama.cpp+random="peer:llama.cpp --madvise random")
bench() {  # bench MODEL OUTDIR bench-args...
  local m=$1 dir=$2; shift 2
  echo "== $m -> $dir"
  "${SLUICE[@]}" bench "$m" --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" --prompt-tokens 32 \
    --peer-python "$PEER_PY" --out "$dir" "$@"
}
for set in $SETS; do
  case $set in
    peers)
      for setting in 1GiB:640MiB 1536MiB:1GiB; do
        C=${setting%%:*}; M=${setting##*:}
        bench "$PEERS/model-Q4_K_M.gguf" "$OUT/peers-$C" --cold --ceiling "$C" \
          --arm sluice="--io direct --memory $M" "${LLAMA[@]}"
      done ;;
    6GiB)
      bench "$SIX/model-Q4_K_M.gguf" "$OUT/6GiB-1GiB" --cold --ceiling 1GiB \
        --arm sluice="--io direct --memory 640MiB" "${LLAMA[@]}" \
        --arm sluice-int8="--io direct --memory 640MiB --activations int8" ;;
    resident)
      bench "$PEERS/model-Q4_K_M.gguf" "$OUT/resident" --warm \
        --arm sluice="--memory all --threads 2" --arm llama.cpp="peer:llama.cpp --threads 2" \
        --arm llama.cpp-norepack="peer:llama.cpp --threads 2 --no-extra-bufts" \
        --arm llama.cpp+random="peer:llama.cpp --threads 2 --madvise random" \
        --arm sluice-int8="--memory all --threads 2 --activations int8" ;;
    bf16)
      bench "$PEERS" "$OUT/bf16-1GiB" --cold --ceiling 1GiB --arm sluice-bf16="--io direct --memory 640MiB" ;;
    fits)  # the file about fits (issue 33): sluice's defaults (--memory auto) against a 1 GiB budget, 1.5 GiB ceiling
      bench "$PEERS/model-Q4_K_M.gguf" "$OUT/fits-1536MiB" --cold --ceiling 1536MiB --arm sluice="--io direct" \
        --arm sluice-1GiB="--io direct --memory 1GiB" "${LLAMA[@]}" ;;
    *) echo "SETS: unknown set '$set' (peers 6GiB resident bf16 fits)" >&2; exit 2 ;;
  esac
done
