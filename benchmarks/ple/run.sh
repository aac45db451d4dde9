#!/usr/bin/env bash
# Issue 31's benchmark: a qwen4_exp (Qwen3.8-Flash-Next) whose n-gram table is larger than the memory ceiling, its
# rows read per pass through mmap (page faults) or sluice's direct-read pool, against llama.cpp's lazy mmap table.
#
# The model: `make-model --arch qwen4_exp` with 4 layers (3 Gated DeltaNet, 1 QSA attention; the PLE block on layer 1,
# as transformers' defaults), hidden 2048 (the table's 16 heads of 128 values: the real row width), 512 experts top-10
# of intermediate 256, an n-gram table of 7.5 GiB in bf16; llama.cpp's converter (q8_0 out), then llama.cpp's quantizer
# to Q4_K_M with the table and token embeddings kept Q8_0 (`--token-embedding-type Q8_0`; 136-byte rows, ~4 GiB;
# its Q4_K_M default would be Q5_0, 88-byte rows, 2.6 GiB). The experts are requantized from Q8_0 (random weights:
# nothing is lost that matters here). Disk: the HF folder is 14 GiB, the Q8_0 file 8 GB, the Q4_K_M file ~5.8 GB; the
# machine this was written on had ~29 GB free, so the folder's safetensors are deleted once converted (config and
# tokenizer kept; KEEP_HF=1 keeps them; make-model rewrites the same bytes from its seed) and the Q8_0 file once
# quantized (KEEP_Q8=1).
#
# Sets (every arm a fresh process on the same GGUF bytes, rotated, paired; `sluice bench`):
#   prompt   for each N in PROMPTS: N tokens of real text (prompt_text.py), cold (the file evicted and verified by
#            mincore), CEILING memory cgroup (page cache included); sluice with the table read by the direct pool
#            (--ple direct) and through a mapping (--ple mmap), the experts streamed the same way in both
#            (--io direct --memory MEMORY); llama.cpp three ways (defaults, --no-extra-bufts, MADV_RANDOM). Then
#            the floor, in the same run: the prompt's own rows of the table (each pass's distinct rows in one
#            batch), cold, by sluice's reader at 8 / 16 / 32 workers, O_DIRECT and buffered, max_gap 64 KiB and 0
#            (row_floor.py)
#   decode   warm, no ceiling, everything else resident: the table's rows read per token from disk (--ple direct)
#            against the table resident (--ple resident)
#
#   bash benchmarks/ple/run.sh    # ROUNDS=3 ROUNDS_LONG=1 CEILING=2GiB MEMORY=1GiB PROMPTS="2048 16384" RUN_TIMEOUT=300
#                                 # RUN_TIMEOUT_LONG=900
#                                 # SETS="prompt decode"
#   PROMPTS=2048 SETS=prompt bash benchmarks/ple/run.sh
# summary.py turns the results into the README table.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; ROUNDS_LONG=${ROUNDS_LONG:-1}; CEILING=${CEILING:-2GiB}; MEMORY=${MEMORY:-1GiB}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}  # seconds a prompt run may take: llama.cpp's defaults thrash at this ceiling (one such
                                 # run read 500 GB in 11 minutes of a 2,048-token prompt; sluice's took ~11 s)
RUN_TIMEOUT_LONG=${RUN_TIMEOUT_LONG:-900}  # the same for prompts over 4,096 tokens
PROMPTS=${PROMPTS:-2048 16384}; SETS=${SETS:-prompt decode}
OUT=${OUT:-benchmarks/results/ple}
PEER_PY=benchmarks/peers/.venv/bin/python
SLUICE=(nice -n 19 .venv/bin/sluice)
[ -x "$PEER_PY" ] && "$PEER_PY" -c "import llama_cpp" 2>/dev/null || bash benchmarks/peers/setup.sh

M=benchmarks/models/qwen4_exp-ple
Q8=$M/model-Q8_0.gguf; Q=$M/model-Q4_K_M.gguf
[ -f "$M/config.json" ] || [ -f "$Q" ] || "${SLUICE[@]}" make-model "$M" --arch qwen4_exp --layers 4 --hidden 2048 --heads 8 \
  --kv-heads 2 --head-dim 128 --expert-intermediate 256 --experts 512 --size 7GiB --ple-size 7.5GiB
if [ ! -f "$Q" ]; then
  [ -f "$Q8" ] || nice -n 19 "$PEER_PY" tests/checkpoint/llama_cpp_child.py convert benchmarks/peers/llama.cpp "$M" \
    --outfile "$Q8" --outtype q8_0
  [ -n "${KEEP_HF:-}" ] || rm -f "$M"/model-*.safetensors "$M"/model.safetensors.index.json
  nice -n 19 "$PEER_PY" benchmarks/quality.py quantize "$Q8" "$Q" Q4_K_M --token-embedding-type Q8_0 \
    --allow-requantize
  [ -n "${KEEP_Q8:-}" ] || rm -f "$Q8"
fi
# make-model writes a 4096-token context; the long prompt needs more (the same 4 bytes rewritten: set_context.py)
.venv/bin/python benchmarks/ple/set_context.py "$Q" 32768
mkdir -p "$OUT"
"${SLUICE[@]}" inspect "$Q" --memory "$MEMORY" > "$OUT/inspect.txt" 2>&1
lscpu > "$OUT/lscpu.txt"

# llama.cpp-norepack+random: repacking off with MADV_RANDOM, llama.cpp's best arm under a ceiling where it was run
# (benchmarks/hybrid/run.sh, 2026-12-05); +random alone keeps repacking wherever the defaults run
LLAMA=(--arm llama.cpp="peer:llama.cpp" --arm llama.cpp-norepack="peer:llama.cpp --no-extra-bufts"
       --arm llama.cpp+random="peer:llama.cpp --madvise random"
       --arm llama.cpp-norepack+random="peer:llama.cpp --no-extra-bufts --madvise random")
for set in $SETS; do
  echo "== $set ($(date -u +%H:%M:%S))"
  case $set in
    prompt)
      for n in $PROMPTS; do
        [ -f "$OUT/prompt-$n.txt" ] || .venv/bin/python benchmarks/ple/prompt_text.py "$M" "$n" "$OUT/prompt-$n.txt"
        rounds=$([ "$n" -le 4096 ] && echo "$ROUNDS" || echo "$ROUNDS_LONG")
        # a text prompt keeps sluice's default context (4096) in `bench`; a longer one needs its own: the prompt
        # (the model's tokenizer counts ~5% more tokens than prompt_text.py's cut) plus room
        ctx=$([ "$n" -le 4096 ] && echo "" || echo "--max-context $((n * 9 / 8 + 512))")
        "${SLUICE[@]}" bench "$Q" --cold --ceiling "$CEILING" --steps 1 --warmup 0 --rounds "$rounds" \
          --run-timeout "$([ "$n" -le 4096 ] && echo "$RUN_TIMEOUT" || echo "$RUN_TIMEOUT_LONG")" \
          --prompt "$(cat "$OUT/prompt-$n.txt")" --peer-python "$PEER_PY" --out "$OUT/prompt-$n" \
          --arm direct="--io direct --memory $MEMORY --ple direct $ctx" \
          --arm mmap="--io direct --memory $MEMORY --ple mmap $ctx" "${LLAMA[@]}" \
          || echo "bench exited $?: an arm failed (killed by --run-timeout, or out of memory; its row says which)"
        nice -n 19 .venv/bin/python benchmarks/ple/row_floor.py "$Q" --from "$OUT/prompt-$n/results.json" \
          --gaps 65536 0 \
          --out "$OUT/floor-$n-after.json"
      done ;;
    decode)
      "${SLUICE[@]}" bench "$Q" --warm --steps 32 --warmup 4 --prompt-tokens 32 --rounds "$ROUNDS" --no-floor \
        --out "$OUT/decode" --arm table-direct="--memory all --ple direct" \
        --arm table-resident="--memory all --ple resident" ;;
    *) echo "SETS: unknown set '$set' (prompt decode)" >&2; exit 2 ;;
  esac
done
.venv/bin/python benchmarks/ple/summary.py "$OUT" | tee "$OUT/summary.md"
