#!/usr/bin/env bash
# `--prefetch router` and `auto` (the default: router's guesses, paused while fewer than 80% of the guessed reads are
# used) against no read-ahead: does guessing the next layer's experts with its router on the residual, and reading
# them while this layer computes, pay, and does auto keep the wins and drop the losses? Each set decodes cold (verified) in a fresh process
# under a memory cgroup, rotated, paired against `none`, the I/O floor measured in the same run; every arm must give
# the reference's tokens:
#   hybrid  issue 30's qwen3_5_moe Q4_K_M (benchmarks/hybrid/run.sh makes it), 1 GiB ceiling, --memory 640MiB
#   peers   the peers qwen3_moe Q4_K_M (benchmarks/peers/setup.sh), 1 GiB, --memory 640MiB
#   demo    the trained demo model inflated to 1.5 GiB (real routing: the guesses meet a trained router),
#           768 MiB ceiling, --memory 384MiB (benchmarks/prefetch.sh's set)
# Arms: none, auto (no --prefetch: the default), router. The demo set decodes DEMO_STEPS (48) steps: auto decides on
# windows of 64 guessed reads, a few of its tokens (the synthetic models read ~240 guesses a token, the demo ~7).
#
#   bash benchmarks/prefetch_router.sh   # ROUNDS=3 STEPS=8 DEMO_STEPS=48 WARMUP=2 SETS="hybrid peers demo"
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-8}; DEMO_STEPS=${DEMO_STEPS:-48}; WARMUP=${WARMUP:-2}
SETS=${SETS:-hybrid peers demo}
OUT=${OUT:-benchmarks/results/prefetch-router}
SLUICE=(nice -n 19 .venv/bin/sluice)
for set in $SETS; do
  case $set in
    hybrid) MODEL=benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf; CEIL=1GiB; MEM=640MiB; PROMPT=(--prompt-tokens 32); N=$STEPS ;;
    peers) MODEL=benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf; CEIL=1GiB; MEM=640MiB; PROMPT=(--prompt-tokens 32); N=$STEPS ;;
    demo) MODEL=benchmarks/models/demo-1.5GiB; CEIL=768MiB; MEM=384MiB; PROMPT=(--prompt "When you"); N=$DEMO_STEPS
      [ -f "$MODEL/config.json" ] || "${SLUICE[@]}" make-model "$MODEL" --from demo --size 1.5GiB ;;
    *) echo "SETS: unknown set '$set' (hybrid peers demo)" >&2; exit 2 ;;
  esac
  [ -e "$MODEL" ] || { echo "$MODEL is missing: benchmarks/hybrid/run.sh or benchmarks/peers/setup.sh makes it" >&2; exit 2; }
  echo "== $set: $MODEL ($(date -u +%H:%M:%S))"
  "${SLUICE[@]}" bench "$MODEL" --cold --ceiling "$CEIL" --rounds "$ROUNDS" --steps "$N" --warmup "$WARMUP" \
    "${PROMPT[@]}" --require-identical --out "$OUT/$set" \
    --arm none="--io direct --memory $MEM --prefetch none" \
    --arm auto="--io direct --memory $MEM" \
    --arm router="--io direct --memory $MEM --prefetch router"
done
