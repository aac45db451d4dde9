#!/usr/bin/env bash
# Issue 6: does prefetch hide I/O? The trained demo model inflated to 1.5 GiB (real routing), cold (verified), each
# arm in a fresh process under a 768 MiB memory cgroup (page cache included), replayed so all arms decode the same
# tokens, rotated and paired against plain `direct`.
#
#   bash benchmarks/prefetch.sh          # ROUNDS=3 STEPS=48 WARMUP=8
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-48}; WARMUP=${WARMUP:-8}
MODEL=benchmarks/models/demo-1.5GiB
MEM="--memory 384MiB"
[ -f "$MODEL/config.json" ] || .venv/bin/sluice make-model "$MODEL" --from demo --size 1.5GiB
# learned heads (MLP, 3072 recorded tokens) beside the model; refit when missing
[ -f "$MODEL/prerouter.safetensors" ] || .venv/bin/sluice prerouter fit "$MODEL" --tokens 3072 --kind mlp
.venv/bin/sluice bench "$MODEL" --cold --ceiling 768MiB --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" \
  --prompt "When you" \
  --arm direct="--io direct --no-odirect $MEM" \
  --arm direct+router="--io direct --no-odirect $MEM --prefetch router --prefetch-margin 2" \
  --arm direct+learned="--io direct --no-odirect $MEM --prefetch learned --prefetch-margin 2" \
  --arm willneed="--io willneed $MEM" \
  --arm willneed+router="--io willneed $MEM --prefetch router --prefetch-margin 2" \
  --require-identical --out benchmarks/results/prefetch
