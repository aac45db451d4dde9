"""A prompt's routes on a CPU with AMX (Compute.amx): the peers Q4_K_M file resident, 2 threads, a 2,048-token
prompt (after a 300-token warm-up prompt), each route in a fresh process, ROUNDS rounds rotated, median seconds:
  vnni+attend   the route before Compute.amx: int8 activations on prompt.c's VNNI tiles, attend.c's attention
  gemm+attend   experts dequantized for torch's bf16 GEMM (AMX), attend.c's attention
  gemm+sdpa     the default on AMX: the bf16 GEMM and torch's flash attention
  gemm+sdpa/256 the same in passes of 256 tokens (--prefill-chunk 256: what a 1 GiB ceiling leaves a streamed
                prompt; each pass runs every touched expert again, dequantized again for its GEMM)
then one layer's causal attention alone (8 heads of 128, 2 kv heads, 256-2,048 positions): attend.causal vs torch's
SDPA on bf16 inputs and widened to float32 on bf16 products (quant/matmul.py sdpa).
Every route's greedy token after the prompt is printed (they round differently, so a tie may differ).

    .venv/bin/python benchmarks/quantized/amx_prompt.py [ROUNDS]   # > benchmarks/results/quantized/amx-prompt/run.txt
"""
import statistics
import subprocess
import sys
import time

Q = "benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf"
ROUTES = ("vnni+attend", "gemm+attend", "gemm+sdpa", "gemm+sdpa/256")


def one(route: str) -> None:
    import torch

    import sluice
    from sluice.quant import compute

    if not route.startswith("gemm+sdpa"):
        import sluice.engine
        sluice.engine.amx_bf16 = lambda: route == "gemm+attend"  # the CPU seen without (or with) AMX
    if route == "gemm+attend":  # AMX's GEMM route with attend.c's attention
        compute.Compute.attend_prompt = property(lambda c: c.dtype is torch.bfloat16 and c.bf16_gemm
                                                 and c.path == compute.BEST and compute.attend.available())
    chunk = {"prefill_chunk": 256} if route.endswith("/256") else {}
    m = sluice.load(Q, memory="all", threads=2, max_context=2100, **chunk)
    warm = torch.randint(3, 32000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.randint(3, 32000, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
    list(m.generate_tokens(warm, max_tokens=1))
    t = time.perf_counter()
    tok = list(m.generate_tokens(ids, max_tokens=1))
    print(f"{time.perf_counter() - t:.3f} {route} prompt_planes={m.compute.prompt_planes} "
          f"attend_prompt={m.compute.attend_prompt} token={tok}")


def attention() -> None:
    import torch
    import torch.nn.functional as F

    from sluice.quant.matmul import sdpa
    from sluice.quant.native import attend

    torch.set_num_threads(2)
    nH, nKV, D = 8, 2, 128
    for T in (256, 512, 1024, 2048):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(n, T, D, generator=g).bfloat16() for n in (nH, nKV, nKV))
        fns = {"attend.causal": lambda: attend.causal(q, k, v, 0),
               "torch sdpa": lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                                    enable_gqa=True),
               # quant/matmul.py sdpa widened (float32 on bf16 products): the model's route on AVX512_BF16 without
               # AMX, and on AMX for passes under AMX_SDPA_MIN_ROWS rows (Compute.sdpa_widen)
               "sdpa widened": lambda: sdpa(q[None], k[None], v[None], True, is_causal=True, enable_gqa=True)}
        for name, f in fns.items():
            f()
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
            ms = 1000 * statistics.median(ts)
            print(f"one layer's causal attention, {T} tokens, {name}: median {ms:.2f} ms of 7")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2])
        sys.exit()
    from sluice.host.cpus import cpu_line, describe_cpu

    print("CPU", cpu_line(describe_cpu()))
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    got = {r: [] for r in ROUTES}
    for i in range(rounds):
        for r in ROUTES[i % len(ROUTES):] + ROUTES[: i % len(ROUTES)]:
            out = subprocess.run([sys.executable, __file__, "--one", r], capture_output=True, text=True, check=True)
            line = out.stdout.strip().splitlines()[-1]
            print(f"round {i + 1}: {line}", flush=True)
            got[r].append(float(line.split()[0]))
    for r in ROUTES:
        print(f"{r:13s} median {statistics.median(got[r]):.2f} s = {2048 / statistics.median(got[r]):.0f} tok/s")
    attention()
