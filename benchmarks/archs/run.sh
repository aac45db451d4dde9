#!/usr/bin/env bash
# One streaming row per architecture (issue 16): a synthetic checkpoint of the family's real proportions and layout
# (`make-model --arch A --size SIZE`: gpt_oss with its MXFP4 experts as shipped), cold (verified), inside a 1 GiB
# memory cgroup (page cache included), `sluice bench` with the direct reader: ms/token and the ratio to the I/O
# floor, measured in the same run (the arm's own reads replayed cold with its reader, before the first round and
# after the last; the ratio divides by the faster). `benchmarks/tables.py archs` gathers the rows.
#
#   bash benchmarks/archs/run.sh     # ARCHS="gpt_oss glm4_moe deepseek_v3" SIZE=3.5GB ROUNDS=3 STEPS=8 WARMUP=2
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCHS=${ARCHS:-gpt_oss glm4_moe deepseek_v3}
SIZE=${SIZE:-3.5GB}; CEILING=${CEILING:-1GiB}; MEMORY=${MEMORY:-640MiB}
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-8}; WARMUP=${WARMUP:-2}
OUT=${OUT:-benchmarks/results/archs}
SLUICE=(nice -n 19 .venv/bin/sluice)
for arch in $ARCHS; do
  M=benchmarks/models/$arch-$SIZE
  [ -f "$M/config.json" ] || "${SLUICE[@]}" make-model "$M" --arch "$arch" --size "$SIZE"
  "${SLUICE[@]}" inspect "$M" --memory "$MEMORY" > "$M/inspect.txt"
  echo "== $arch: $M, ceiling $CEILING, --memory $MEMORY"
  "${SLUICE[@]}" bench "$M" --cold --ceiling "$CEILING" --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" \
    --prompt-tokens 32 --arm direct="--io direct --memory $MEMORY" --out "$OUT/$arch"
done
.venv/bin/python benchmarks/tables.py archs $(for a in $ARCHS; do echo "$OUT/$a"; done) > "$OUT/README.md"
cat "$OUT/README.md"
