#!/usr/bin/env bash
# Where a decode token's CPU goes, by thread: `perf record -a -e cpu-clock` (a software clock: VMs without a PMU have
# it) over the decode window of issue 30's Q4_K_M file, then perf_threads.py's table (each thread's samples by leaf
# symbol). streamed: a fresh process in a 1 GiB memory cgroup, cold, --memory 640MiB, O_DIRECT, a 32-token prompt,
# N tokens after 2 (the bench's shape); router: the same with --prefetch router; resident: everything in memory, 40
# tokens after 2.
#   bash benchmarks/results/hybrid/perf_step.sh streamed|router|resident OUT.txt [N]
set -euo pipefail
mode=$1 out=$2 n=${3:-20}
Q=benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf
tmp=$(mktemp -d)
cat > "$tmp/work.py" <<'PY'
import sys, time
import sluice
q, mode, n, flag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
opts = dict(memory="640MiB", io="direct", odirect=True) if mode != "resident" else dict(memory="all")
if mode != "resident":  # streamed: no guesses (the default before 2026-12-05); router: --prefetch router
    opts["prefetch"] = "router" if mode == "router" else "none"
m = sluice.load(q, threads=2, max_context=512, **opts)
g = m.generate_tokens(list(range(100, 132)), max_tokens=n + 2, temperature=0.0)
next(g); next(g)
open(flag + ".go", "w").close(); time.sleep(2)  # perf -a takes a moment to start sampling (the idle thread 0 of the table counts these 2 s too)
t0 = time.perf_counter(); k = sum(1 for _ in g)
print(f"{mode}: {k} tokens {(time.perf_counter() - t0) / k * 1000:.1f} ms/token", flush=True)
open(flag + ".stop", "w").close()
PY
if [ "$mode" != resident ]; then
  .venv/bin/python -c "
import sys
from sluice.io.residency import evict, run_in_memory_cgroup
evict(sys.argv[1])
sys.exit(run_in_memory_cgroup(['.venv/bin/python', *sys.argv[2:]], 1 << 30).returncode)" "$Q" "$tmp/work.py" "$Q" "$mode" "$n" "$tmp/f" > "$tmp/log" &
else
  .venv/bin/python "$tmp/work.py" "$Q" resident 40 "$tmp/f" > "$tmp/log" &
fi
W=$!
while [ ! -f "$tmp/f.go" ]; do sleep 0.05; done
perf record -a -g -F 999 -e cpu-clock -o "$tmp/perf.data" -- bash -c "while [ ! -f $tmp/f.stop ]; do sleep 0.05; done" 2>/dev/null
wait $W
{ echo "# bash benchmarks/results/hybrid/perf_step.sh $mode $out $n   (at $(git rev-parse --short HEAD), $(date -u '+%F %H:%M') UTC; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs, flags: $(grep -m1 -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|amx_tile' /proc/cpuinfo | sort -u | xargs))"
  cat "$tmp/log"; .venv/bin/python benchmarks/results/hybrid/perf_threads.py "$tmp/perf.data" 25; } > "$out"
rm -rf "$tmp"
