#!/usr/bin/env bash
# The direct reader's two engines on issue 30's streamed decode (benchmarks/hybrid/run.sh makes the model): preader.c's
# C threads (`--io-engine native`, the default where built) against the Python threads (`--io-engine python`), same
# file, cold, 1 GiB memory cgroup, paired rounds, each arm's own I/O floor measured in the run.
#
#   OUT=benchmarks/results/hybrid/native-reader bash benchmarks/hybrid/reader_ab.sh   # ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/../.."
Q=benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf
.venv/bin/python benchmarks/results/hybrid/probe.py
nice -n 19 .venv/bin/sluice bench "$Q" --rounds "${ROUNDS:-3}" --out "${OUT:-benchmarks/results/hybrid/native-reader}" \
  --cold --ceiling 1GiB --steps 8 --warmup 2 --prompt-tokens 32 \
  --arm sluice="--io direct --memory 640MiB" --arm sluice-pyio="--io direct --memory 640MiB --io-engine python"
