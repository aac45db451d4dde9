"""Aggregate tokens/s of `sluice serve` alone and of `sluice serve --ray` replicas, under concurrent clients (issue 34).

Each arm is a server started fresh per round (`sluice serve MODEL ARGS`), warmed (one untimed request per replica,
at once), then timed: CLIENTS threads of the official openai client each send REQUESTS greedy completions one
after another (streamed with --stream); an arm's figure is the completion tokens of all of them over the wall time
from the first request to the last answer. Every arm gets the same prompts (distinct first words: no cached prefix is reused across them) and
the same max_tokens; the arms run in rotated order per round (sluice.bench.protocol.rotation) and the summary gives
per-round figures and medians. Memory: each server process's peak RSS (VmHWM), and for Ray each replica's and the
sizing line `sluice serve --ray` prints (replicas, threads, budget, bytes each). CPU: the seconds each process of
the server spent during the timed load (/proc utime + stime), per completion token: the replicas' (or the plain
server's) against everything else Ray runs (ingress, proxy, controller, raylet, GCS, agents); and the CPUs the rest
of the machine kept busy meanwhile (all busy time in /proc/stat less the server's and this script's): the VM is
shared, and a round another job slowed shows there.

    PYTHONPATH=. .venv/bin/python benchmarks/ray/bench.py MODEL --out DIR [--rounds 3 --clients 4 --requests 4
        --max-tokens 64] [--arm NAME="serve args" ...] [--memory SIZE] [--stream]

Writes DIR/runs.jsonl (one object per arm and round), DIR/logs/ (each server's output) and DIR/summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402

from benchmarks.common import descendants  # noqa: E402
from sluice.bench.protocol import rotation  # noqa: E402

ARMS = {  # the comparison: one server on 2 threads against 1 and 2 replicas of 1 thread (and 1 thread alone)
    "serve-2t": "--threads 2",
    "serve-1t": "--threads 1",
    "ray-1x1t": "--ray --replicas 1 --threads 1",
    "ray-2x1t": "--ray --replicas 2 --threads 1",
}
# the demo model writes about Python's documentation: prompts it continues, each starting with its own word
PROMPTS = ["When you", "The module", "This function", "To create", "If the", "A list", "Each thread", "In Python",
           "An exception", "Return the", "For example", "Use the", "Every object", "Calling this", "Note that",
           "Some platforms"]
REPLICA = b"ray::ServeReplica:sluice:replica"
# A round is quiet when the rest of the machine took less than this many CPUs meanwhile (the VM is shared; an arm
# using both CPUs loses to any other job, so a busy round measures that job)
QUIET = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def machine_ticks() -> int:
    """CPU time the whole machine has spent busy (/proc/stat: user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))


def cpu_ticks(pids) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return out


def cpu_split(proc: subprocess.Popen, before: dict[int, int], after: dict[int, int], below: dict[int, bytes],
              tokens: int) -> dict:
    """CPU ms per completion token during the load: the engines' (the plain server, or the Ray replicas) and the
    rest of the server's processes."""
    hz = os.sysconf("SC_CLK_TCK")
    engine = [p for p, c in below.items() if c.startswith(REPLICA)] or [proc.pid]
    spent = {p: after[p] - before.get(p, 0) for p in after}
    eng = sum(spent.get(p, 0) for p in engine)
    rest = sum(spent.values()) - eng
    return {"engine_cpu_ms_per_token": round(1000 * eng / hz / tokens, 2),
            "other_cpu_ms_per_token": round(1000 * rest / hz / tokens, 2)}


def memory(proc: subprocess.Popen) -> dict:
    """Peak RSS (MiB) of the server process and of each Ray replica below it; RSS now of everything below it."""
    below = descendants(proc.pid)
    out = {"server_peak_mib": round(status_kib(proc.pid, "VmHWM") / 1024, 1),
           "replica_peak_mib": sorted(round(status_kib(p, "VmHWM") / 1024, 1) for p, c in below.items()
                                      if c.startswith(REPLICA))}
    out["all_processes_rss_mib"] = round((status_kib(proc.pid, "VmRSS")
                                          + sum(status_kib(p, "VmRSS") for p in below)) / 1024, 1)
    return out


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:g} s:\n{log.read_text()[-3000:]}")


def complete(client: openai.OpenAI, prompt: str, max_tokens: int, stream: bool = False) -> tuple[int, float]:
    """(completion tokens, seconds) of one greedy completion, streamed (read to its end) or not."""
    t = time.perf_counter()
    if stream:
        chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage.completion_tokens, time.perf_counter() - t
    r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.usage.completion_tokens, time.perf_counter() - t


def drive(url: str, clients: int, requests: int, max_tokens: int, stream: bool) -> dict:
    """The timed load: `clients` threads, each `requests` completions in a row."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    start = threading.Barrier(clients)

    def one_client(c: int) -> list[tuple[int, float]]:
        start.wait()
        return [complete(client, PROMPTS[(c * requests + j) % len(PROMPTS)], max_tokens, stream)
                for j in range(requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one_client, range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(n for client_done in done for n, _ in client_done)
    latencies = [s for client_done in done for _, s in client_done]
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "request_s_median": round(statistics.median(latencies), 3)}


def run_arm(model: str, name: str, args: str, extra: list[str], out: Path, rnd: int, load: dict) -> dict:
    port, log = free_port(), out / "logs" / f"{name}-r{rnd}.log"
    cmd = [sys.executable, "-m", "sluice", "serve", model, "--port", str(port), "--model-name", "m",
           "--max-queue", "64", *args.split(), *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        replicas = int(args.split("--replicas")[1].split()[0]) if "--replicas" in args else 1
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
        with ThreadPoolExecutor(replicas) as pool:  # warm-up, untimed: one request on every replica
            list(pool.map(lambda i: complete(client, PROMPTS[i], 8), range(replicas)))
        below = descendants(proc.pid)
        pids = [proc.pid, *below]
        before, machine, me = cpu_ticks(pids), machine_ticks(), cpu_ticks([os.getpid()])[os.getpid()]
        result = drive(url, **load)
        after = cpu_ticks(pids)
        result.update(cpu_split(proc, before, after, below, result["tokens"]))
        server = sum(after[p] - before.get(p, 0) for p in after)
        mine = cpu_ticks([os.getpid()])[os.getpid()] - me
        busy = (machine_ticks() - machine - server - mine) / os.sysconf("SC_CLK_TCK")
        result["elsewhere_cpus"] = round(busy / result["wall_s"], 2)
        result.update(memory(proc))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    sizing = [line.split(": ", 2)[-1] for line in log.read_text().splitlines() if line.startswith("sluice serve: model")]
    return {"arm": name, "round": rnd, "args": args, **result, "startup_line": sizing[0] if sizing else ""}


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
    isa = [f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))]
    return f"{model}, {os.cpu_count()} logical CPUs, flags: {' '.join(isa)}"


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "sluice", "benchmarks/ray"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def summary(runs: list[dict], arms: dict, load: dict, argv: list[str]) -> str:
    lines = ["# Replicas behind Ray Serve against one `sluice serve` (issue 34)", "",
             f"Command: `PYTHONPATH=. .venv/bin/python benchmarks/ray/bench.py {' '.join(argv)}`  ",
             f"CPU: {cpu()}  ", f"Commit: {commit()}  ",
             f"Load: {load['clients']} concurrent clients x {load['requests']} greedy completions of up to "
             f"{load['max_tokens']} tokens each, {'streamed' if load['stream'] else 'not streamed'}, per arm and "
             "round", "",
             f"| arm | serve args | tok/s per round | median tok/s | median tok/s of quiet rounds (other jobs < "
             f"{QUIET} CPU) | median request s | tokens | CPU ms/token: engines + rest | CPUs other jobs took, per "
             "round | peak RSS MiB: server / each replica | all processes RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, args in arms.items():
        mine = [r for r in runs if r["arm"] == name]
        rates = [r["tok_s"] for r in mine]
        quiet = [r["tok_s"] for r in mine if r["elsewhere_cpus"] < QUIET]
        last = mine[-1]
        lines.append(f"| {name} | `{args}` | {', '.join(f'{x:.1f}' for x in rates)} | "
                     f"{statistics.median(rates):.1f} | "
                     + (f"{statistics.median(quiet):.1f} ({len(quiet)} of {len(rates)})" if quiet else "-")
                     + f" | {statistics.median(r['request_s_median'] for r in mine):.2f}"
                     f" | {', '.join(str(r['tokens']) for r in mine)} | "
                     f"{statistics.median(r['engine_cpu_ms_per_token'] for r in mine):.1f} + "
                     f"{statistics.median(r['other_cpu_ms_per_token'] for r in mine):.1f} | "
                     f"{', '.join(format(r['elsewhere_cpus'], '.2f') for r in mine)} | "
                     f"{last['server_peak_mib']:.0f} / "
                     f"{', '.join(f'{m:.0f}' for m in last['replica_peak_mib']) or '-'} | "
                     f"{last['all_processes_rss_mib']:.0f} |")
    lines += ["", "Start-up lines (the sizing of each arm):", ""]
    lines += [f"- {name}: {next(r['startup_line'] for r in runs if r['arm'] == name)}" for name in arms]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="per client, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--arm", action="append", default=None, metavar='NAME="ARGS"',
                   help="an arm's `sluice serve` arguments (repeatable; default: the four of ARMS)")
    p.add_argument("--memory", default=None, help="--memory for every arm (default: sluice's auto)")
    p.add_argument("--stream", action="store_true", help="the clients stream their completions (server-sent events)")
    a = p.parse_args()
    arms = dict(x.split("=", 1) for x in a.arm) if a.arm else dict(ARMS)
    extra = ["--memory", a.memory] if a.memory else []
    load = {"clients": a.clients, "requests": a.requests, "max_tokens": a.max_tokens, "stream": a.stream}
    (a.out / "logs").mkdir(parents=True, exist_ok=True)
    runs = []
    with open(a.out / "runs.jsonl", "w") as f:
        for rnd in range(a.rounds):
            for name in rotation(list(arms), rnd):
                r = run_arm(a.model, name, arms[name], extra, a.out, rnd, load)
                print(json.dumps(r), flush=True)
                f.write(json.dumps(r) + "\n")
                runs.append(r)
    (a.out / "summary.md").write_text(summary(runs, arms, load, sys.argv[1:]))
    print((a.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
