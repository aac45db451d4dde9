#!/usr/bin/env bash
# sluice against what users run instead (issue 8): llama.cpp's mmap path (llama-cpp-python on a GGUF that sluice
# exports from the same checkpoint) and transformers + accelerate disk offload, as arms of one `sluice bench` run:
# the same 3.4 GB bf16 qwen3_moe (16 layers, 64 experts top-8, one expert = 3 MiB, 403 MB of expert weights per
# token, routing spread like a trained model's), verified cold before every run, each run in a fresh process inside
# a 1 GiB memory cgroup (page cache included), every arm replaying the tokens sluice's reference arm generated.
#
#   bash benchmarks/peers/run.sh       # ROUNDS=3 STEPS=8 WARMUP=2; llama.cpp and accelerate take ~3 s/token here
#
# Builds what is missing first: the peers' venv (benchmarks/peers/setup.sh, ~8 min), the model (~1 min) and its
# GGUF (~2.5 min). Everything runs under nice: the machine is shared.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-8}; WARMUP=${WARMUP:-2}
CEILING=${CEILING:-1GiB}
MEM=${MEM:-640MiB}              # sluice's budget (resident weights + expert cache); the rest of the ceiling is runtime
ACC_MEM=${ACC_MEM:-256MiB}      # accelerate's max_memory["cpu"]; the rest is offloaded to disk
MODEL=${MODEL:-benchmarks/models/qwen3_moe-peers}
OUT=${OUT:-benchmarks/results/peers}
PEER_PY=benchmarks/peers/.venv/bin/python
SLUICE=(nice -n 19 .venv/bin/sluice)

[ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp, accelerate" 2>/dev/null || bash benchmarks/peers/setup.sh
[ -f "$MODEL/config.json" ] || "${SLUICE[@]}" make-model "$MODEL" --arch qwen3_moe --size 3.4GB --layers 16 \
  --experts 64 --top-k 8 --expert-intermediate 512
# bf16: the checkpoint's own bytes (f32 would make llama.cpp read twice as much); inside the model folder, so the
# cold protocol evicts and verifies it with the safetensors
[ -f "$MODEL/model.gguf" ] || "${SLUICE[@]}" export-gguf "$MODEL" "$MODEL/model.gguf" --dtype bf16

"${SLUICE[@]}" bench "$MODEL" --cold --ceiling "$CEILING" --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" \
  --arm direct="--io direct --memory $MEM" \
  --arm direct+odirect="--io direct --odirect --memory $MEM" \
  --arm llama.cpp="peer:llama.cpp" \
  --arm llama.cpp+random="peer:llama.cpp --madvise random" \
  --arm accelerate="peer:accelerate --max-memory $ACC_MEM" \
  --peer-python "$PEER_PY" --out "$OUT" "$@"
