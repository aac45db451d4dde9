#!/usr/bin/env bash
# Issue 34: aggregate tokens/s of replicas behind Ray Serve (`sluice serve --ray`) against one `sluice serve`, at 4
# concurrent clients, on this machine. The model is the trained demo model inflated to 1 GiB (bf16, 6 layers, 32
# experts top-4; common.py DEMO_1G), so the clients' completions are real text. Arms (benchmarks/ray/bench.py ARMS):
# one `sluice serve` on 2 threads and on 1, and 1 and 2 Ray replicas of 1 thread each. Each arm is a fresh server per
# round, rotated order, one untimed request per replica first; the figures are completion tokens over wall time.
#   resident         --memory auto: every replica holds the whole model (the machine has room for several); the
#                    clients' completions are not streamed (a replica sends each one's text at its end)
#   resident-stream  the same, the clients streaming (server-sent events: a Ray item per piece of text)
#   budget           --memory 512MiB for every server and every replica: each streams half its experts from disk
#
#   bash benchmarks/ray/run.sh     # ROUNDS=3 CLIENTS=4 REQUESTS=4 MAX_TOKENS=64 SETS="resident resident-stream"
#                                  # PY=.venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; CLIENTS=${CLIENTS:-4}; REQUESTS=${REQUESTS:-4}; MAX_TOKENS=${MAX_TOKENS:-64}
SETS=${SETS:-resident resident-stream}; PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/ray}
M=benchmarks/models/qwen3_moe-1GiB
[ -f "$M/config.json" ] || PYTHONPATH=. "$PY" -m sluice make-model "$M" --from demo --size 1GiB
LOAD=(--rounds "$ROUNDS" --clients "$CLIENTS" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS")
for set in $SETS; do
  echo "== $set ($(date -u +%H:%M:%S))"
  case $set in
    resident) PYTHONPATH=. "$PY" benchmarks/ray/bench.py "$M" --out "$OUT/resident" "${LOAD[@]}" ;;
    resident-stream) PYTHONPATH=. "$PY" benchmarks/ray/bench.py "$M" --out "$OUT/resident-stream" "${LOAD[@]}" --stream ;;
    budget) PYTHONPATH=. "$PY" benchmarks/ray/bench.py "$M" --out "$OUT/budget-512MiB" "${LOAD[@]}" --memory 512MiB ;;
    *) echo "SETS: unknown set '$set' (resident resident-stream budget)" >&2; exit 2 ;;
  esac
done
