"""One build's decode-shape projections through sluice_linear_q8 (the library call: x coded, rows_q8's loop, one thread),
[2048 x 512] at T=1, one plane, best of 5 x 1000 calls (us of thread CPU time), each output saved to /tmp for a bitwise
comparison with another build's. rows_ab.sh runs two builds of the extension alternately:

    bash benchmarks/results/lowbit/rows_ab.sh OLD.so NEW.so   # each a built _kernels*.so
"""
import sys, time
sys.path.insert(0, "/work/main")
from benchmarks.lowbit_kernels import *  # noqa
import numpy as np
torch.set_num_threads(1); pool.set_threads(1)
out = []
for name in ("Q2_K", "Q3_K", "IQ2_XXS", "Q4_K", "Q6_K", "Q8_0"):
    spec = QuantSpec.ggml(name, 2048, 512)
    raw = random_stored(spec, seed=1)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(2)); y = torch.empty(1, 2048)
    f = sluice_arm(spec, raw, x, y, 1, 1000); f()
    t = min(f() for _ in range(5))
    out.append(f"{name} {t:.1f}")
    np.save(f"/tmp/rows_{name}_{sys.argv[1]}.npy", y.numpy())
print(sys.argv[1], " | ".join(out))
