#!/usr/bin/env bash
# Two checkouts' streamed decode on the same file, a fresh process each, alternated (A B B A A B ...): ms a token over
# 64 greedy tokens after 40 (benchmarks/common.py decode_stream, MODE as decode_options: auto = --memory 640MiB,
# O_DIRECT, --prefetch auto, no cgroup). Each tree's sluice comes first on PYTHONPATH; the native extensions must be
# built in each (setup.py build_ext --inplace).
#
#   bash benchmarks/results/hybrid/tree_ab.sh A_TREE B_TREE [MODEL] [MODE] [ROUNDS]
set -euo pipefail
A=$1; B=$2; MODEL=${3:-benchmarks/models/qwen3_5_moe-a3b-8GiB/model-UD-IQ2_XXS.gguf}; MODE=${4:-auto}; ROUNDS=${5:-4}
PY=${PY:-.venv/bin/python}
run() {  # run TREE -> ms a token
  PYTHONPATH="$1" "$PY" -c "
import sluice, sys
from benchmarks.common import decode_stream, timed_tokens
m, it = decode_stream('$MODEL', '$MODE')
print(f'{timed_tokens(it, 64):.2f}')" 2>/dev/null
}
echo "tree_ab $(date -u +%FT%TZ) A=$A ($(git -C "$A" rev-parse --short HEAD)$(git -C "$A" diff --quiet || echo +changes)) B=$B ($(git -C "$B" rev-parse --short HEAD)$(git -C "$B" diff --quiet || echo +changes)) $MODEL $MODE"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) flags: $(grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for arm in $order; do
    tree=$([ "$arm" = A ] && echo "$A" || echo "$B")
    echo "round $r $arm $(run "$tree") ms/token"
  done
done
