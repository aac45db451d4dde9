"""How a streamed prompt's slots are filled: staged copies vs reads in place, 4 KiB vs huge pages, and the prompt
read-ahead, on the same prompts (issue 15).

Each arm runs in a fresh process per round (arms rotated each round), loads MODEL with `--io direct --odirect`
(O_DIRECT: no page cache, every read from the disk, so no ceiling is needed) at `--memory`, and runs PROMPTS prompts
of `--prompt` random tokens (a new prompt each, so nothing is reused); the first one is warm-up (oneDNN builds its
kernels then). Reported per arm: median prefill ms over the timed prompts of all rounds, the store's I/O wait, the
reader's bytes copied out of staging per prompt, and the process's system CPU time per prompt.

  .venv/bin/python benchmarks/prefill/slots.py benchmarks/models/qwen3_moe-peers/model.gguf --rounds 3

Arms (later arms add to earlier ones):
  staged      slots as stored in 4 KiB pages, every O_DIRECT read copied out of a staging buffer, no read-ahead
  in-place    slots placed at the file's offsets modulo the page: whole pages read straight into them
  huge        + the slots in transparent huge pages (what `sluice run` does)
  read-ahead  + the next layer's experts read during a prompt's expert math (--prompt-prefetch, the default)
  staged-huge (not run unless named in --arms) staged copies into slots in huge pages
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

ARMS = ("staged", "in-place", "huge", "read-ahead")
EXTRA = ("staged-huge",)  # staged copies into slots in huge pages (--arms staged-huge,...)


def child(model: str, memory: str, prompt: int, prompts: int, arm: str) -> dict:
    import sluice  # before torch: the OpenMP policy `sluice run` gets
    import torch

    from sluice.store import streaming

    if arm in ("staged", "staged-huge"):
        streaming.PAGE_ALIGNED_MIN_SLOT = 1 << 62
    if arm in ("staged", "in-place"):
        def small_pages(rows: int, stride: int) -> torch.Tensor:  # _page_rows in 4 KiB pages
            buf = mmap.mmap(-1, rows * stride, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_NOHUGEPAGE)
            return torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride).fill_(0)

        streaming._page_rows = small_pages
    out = {"prefill_ms": [], "io_wait_ms": [], "copied_mib": [], "sys_s": []}
    with sluice.load(model, memory=memory, io="direct", odirect=True,
                     prompt_prefetch=arm == "read-ahead") as m:
        for i in range(prompts):
            ids = torch.randint(100, m.spec.vocab_size, (prompt,), generator=torch.Generator().manual_seed(i)).tolist()
            w0, c0, s0 = m.store.io_wait_s, m.reader.stats()["copied_bytes"], os.times().system
            list(m.generate_tokens(ids, max_tokens=1))
            if i == 0:
                continue  # warm-up
            out["prefill_ms"].append(m.stats()["prefill_ms"])
            out["io_wait_ms"].append(1000 * (m.store.io_wait_s - w0))
            out["copied_mib"].append((m.reader.stats()["copied_bytes"] - c0) / 2**20)
            out["sys_s"].append(os.times().system - s0)
        out["slots"] = m.store.n_slots
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--memory", default="512MiB")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=3, help="per process, the first one untimed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.memory, a.prompt, a.prompts, a.child)))
        return
    arms = a.arms.split(",")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:  # rotated
            t = time.perf_counter()
            res = subprocess.run([sys.executable, __file__, a.model, "--memory", a.memory, "--prompt", str(a.prompt),
                                  "--prompts", str(a.prompts), "--child", arm], capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"arm {arm} failed:\n{res.stderr[-3000:]}")
            runs[arm].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {arm}: {runs[arm][-1]['prefill_ms']} ms ({time.perf_counter() - t:.0f} s)",
                  file=sys.stderr)
    print(f"{os.path.basename(a.model)}, {a.prompt}-token prompts, --memory {a.memory}, O_DIRECT, {a.rounds} rounds "
          f"x {a.prompts - 1} timed prompts per arm (medians)\n")
    print("| arm | slots | prefill ms | vs first arm | I/O wait ms | copied MiB | system CPU s |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for arm in arms:
        med = {k: statistics.median(v for run in runs[arm] for v in run[k])
               for k in ("prefill_ms", "io_wait_ms", "copied_mib", "sys_s")}
        base = base or med["prefill_ms"]
        print(f"| {arm} | {runs[arm][0]['slots']} | {med['prefill_ms']:.0f} | {med['prefill_ms'] / base:.2f} | "
              f"{med['io_wait_ms']:.0f} | {med['copied_mib']:.0f} | {med['sys_s']:.2f} |")


if __name__ == "__main__":
    main()
