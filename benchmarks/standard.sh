#!/usr/bin/env bash
# The standard streaming benchmark (issue 4): a ~6 GiB synthetic qwen3_moe (routing spread like a trained model's),
# cold (verified), each arm in a fresh process inside a 1.5 GiB memory cgroup (page cache included), replayed so every
# arm decodes the same tokens, rotated order, paired medians, step time against the I/O floor measured in the
# same run (each arm's own reads replayed cold before the first round and after the last).
# Resident is impossible under the ceiling, so the arms are the four readers at one budget.
#
#   bash benchmarks/standard.sh            # ROUNDS=3 STEPS=20 WARMUP=4 by default (mmap runs ~5 s/token here)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-20}; WARMUP=${WARMUP:-4}
MODEL=benchmarks/models/qwen3_moe-6GiB
MEM=${MEM:-1GiB}
[ -f "$MODEL/config.json" ] || .venv/bin/sluice make-model "$MODEL" --arch qwen3_moe --size 6GiB
.venv/bin/sluice bench "$MODEL" --cold --ceiling 1.5GiB --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" \
  --arm mmap="--io mmap --memory $MEM" \
  --arm willneed="--io willneed --memory $MEM" \
  --arm direct="--io direct --no-odirect --memory $MEM" \
  --arm direct+odirect="--io direct --odirect --memory $MEM" \
  --require-identical --out benchmarks/results/standard
