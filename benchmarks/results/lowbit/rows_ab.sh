# bash benchmarks/results/lowbit/rows_ab.sh OLD.so NEW.so: rows_ab.py under each build of sluice's extension, 3
# alternating rounds (the extension file swapped between runs; the new one left in place), then whether each type's
# outputs are the same bits under both. Nothing else may run meanwhile.
set -euo pipefail
if [ $# -ne 2 ] || [ ! -f "$1" ] || [ ! -f "$2" ]; then
  echo "usage: bash benchmarks/results/lowbit/rows_ab.sh OLD.so NEW.so (two built _kernels*.so files)" >&2; exit 2
fi
cd "$(dirname "$0")/../../.."
SO=$(ls sluice/quant/native/_kernels*.so)
for r in 1 2 3; do
  for v in old new; do
    [ $v = old ] && cp "$1" "$SO" || cp "$2" "$SO"
    .venv/bin/python benchmarks/results/lowbit/rows_ab.py $v | tail -1
  done
done
.venv/bin/python - <<'PY'
import numpy as np
for n in ("Q2_K", "Q3_K", "IQ2_XXS", "Q4_K", "Q6_K", "Q8_0"):
    a, b = np.load(f"/tmp/rows_{n}_old.npy"), np.load(f"/tmp/rows_{n}_new.npy")
    print(n, "outputs differing:", int((a.view(np.int32) != b.view(np.int32)).sum()))
PY
