# the machine's state: a bf16 GEMM [256x1024]@[1024x1024], 2 threads (0.56-0.57 ms in the quiet state; stop 27's notes)
import time, torch
torch.set_num_threads(2)
a = torch.randn(256, 1024).bfloat16(); b = torch.randn(1024, 1024).bfloat16()
for _ in range(20): a @ b.t()
ts = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(100): a @ b.t()
    ts.append((time.perf_counter() - t) / 100 * 1000)
print(f"probe: bf16 GEMM 256x1024x1024, 2 threads: median {sorted(ts)[2]:.3f} ms (quiet state ~0.57)")
