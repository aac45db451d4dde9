#!/usr/bin/env bash
# sluice against what users run instead (issue 8): llama.cpp's mmap path (llama-cpp-python on a GGUF that sluice
# exports from the same checkpoint; three ways: its defaults, repacked CPU buffers on unless they crash on this CPU,
# where the bench falls back to off and says so; repacking off; MADV_RANDOM) and transformers + accelerate disk
# offload, as arms of one `sluice bench` run per
# model, verified cold before every run, each run in a fresh process inside a 1 GiB memory cgroup (page cache
# included), every arm replaying the tokens sluice's reference arm generated. Two models, ~3.4 GB bf16 each:
#   synthetic  qwen3_moe, 16 layers, 64 experts top-8, one expert = 3 MiB, 403 MB of expert weights per token,
#              random weights with routing spread like a trained model's; a 32-token seeded random prompt
#   demo       the trained demo model (6 layers, 32 experts top-4) inflated x180 with zero-padded experts (one
#              expert = 17 MiB, 425 MB of expert weights per token; same tokens as the 26 MiB original), so the
#              routing is a trained model's on real text; an English prompt
#
#   bash benchmarks/peers/run.sh                    # both models; ROUNDS=3 STEPS=8 WARMUP=2 (~45 min in all)
#   MODELS=demo bash benchmarks/peers/run.sh --require-identical
#
# Builds what is missing first: the peers' venv (benchmarks/peers/setup.sh, ~8 min), the models (~1 min each) and
# their GGUFs (~2.5 min each). Everything runs under nice: the machine is shared.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODELS=${MODELS:-synthetic demo}
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-8}; WARMUP=${WARMUP:-2}
# CEILING:MEMORY pairs per model: the cgroup limit of every arm (page cache included), and sluice's --memory budget
# (resident weights + expert cache; the rest of the ceiling is torch's runtime, ~250 MiB). accelerate is OOM-killed
# loading the demo model at 1 GiB (transformers fuses a layer's 32 experts into one 360 MiB tensor while loading), so
# the demo also runs at 1.5 GiB, where every peer finishes.
SYNTHETIC_SETTINGS=${SYNTHETIC_SETTINGS:-1GiB:640MiB}
DEMO_SETTINGS=${DEMO_SETTINGS:-1GiB:640MiB 1536MiB:1GiB}
ACC_MEM=${ACC_MEM:-256MiB}      # accelerate's max_memory["cpu"]; the rest is offloaded to disk
OUT=${OUT:-benchmarks/results/peers}
DEMO_PROMPT=${DEMO_PROMPT:-"The for statement in Python differs a bit from what you may be used to in C or Pascal. \
Rather than always iterating over an arithmetic progression of numbers, it iterates over the items of any sequence"}
PEER_PY=benchmarks/peers/.venv/bin/python
SLUICE=(nice -n 19 .venv/bin/sluice)

[ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp, accelerate" 2>/dev/null || bash benchmarks/peers/setup.sh

for kind in $MODELS; do
  case $kind in
    synthetic)
      MODEL=benchmarks/models/qwen3_moe-peers
      [ -f "$MODEL/config.json" ] || "${SLUICE[@]}" make-model "$MODEL" --arch qwen3_moe --size 3.4GB --layers 16 \
        --experts 64 --top-k 8 --expert-intermediate 512
      SETTINGS=$SYNTHETIC_SETTINGS; PROMPT=(--prompt-tokens 32) ;;
    demo)
      MODEL=benchmarks/models/demo-peers
      [ -f "$MODEL/config.json" ] || "${SLUICE[@]}" make-model "$MODEL" --from demo --size 3.4GB
      SETTINGS=$DEMO_SETTINGS; PROMPT=(--prompt "$DEMO_PROMPT") ;;
    *) echo "MODELS: unknown model '$kind' (synthetic, demo)" >&2; exit 2 ;;
  esac
  # bf16: the checkpoint's own bytes (f32 would make llama.cpp read twice as much); inside the model folder, so the
  # cold protocol evicts and verifies it with the safetensors
  [ -f "$MODEL/model.gguf" ] || "${SLUICE[@]}" export-gguf "$MODEL" "$MODEL/model.gguf" --dtype bf16

  for setting in $SETTINGS; do
    CEILING=${setting%%:*}; MEM=${setting##*:}
    DIR=$OUT/$kind; [ "$CEILING" = 1GiB ] || DIR=$OUT/$kind-$CEILING
    echo "== $kind: $MODEL, ceiling $CEILING, sluice --memory $MEM -> $DIR"
    "${SLUICE[@]}" bench "$MODEL" --cold --ceiling "$CEILING" --rounds "$ROUNDS" --steps "$STEPS" --warmup "$WARMUP" \
      "${PROMPT[@]}" \
      --arm direct="--io direct --no-odirect --memory $MEM" \
      --arm direct+odirect="--io direct --odirect --memory $MEM" \
      --arm llama.cpp="peer:llama.cpp" \
      --arm llama.cpp-norepack="peer:llama.cpp --no-extra-bufts" \
      --arm llama.cpp+random="peer:llama.cpp --madvise random" \
      --arm llama.cpp-norepack+random="peer:llama.cpp --no-extra-bufts --madvise random" \
      --arm accelerate="peer:accelerate --max-memory $ACC_MEM" \
      --peer-python "$PEER_PY" --out "$DIR" "$@"
  done
done
