"""pool.c under stress: many short jobs back to back, several thread counts, two calling threads, a fork.

sluice_pool_check (pool.c) runs jobs whose tasks count themselves into rows that change from job to job (context
and function both alternate), so a task run twice, skipped, run with the previous job's context or function, or
still running when its job returned, shows in the counts; the real kernels' outputs are compared bitwise with one
thread's.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from sluice.quant import native
from sluice.quant.native import ops, pool
from sluice.quant.native._lib import LIB, PORTABLE

pytestmark = pytest.mark.skipif(LIB is None, reason="native kernels not built")

if LIB is not None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    LIB.sluice_pool_check.argtypes = [i64, ptr, i64, ptr, i64, i64]  # jobs, ntasks, nsizes, counts, stride, spin
    LIB.sluice_pool_check.restype = i64  # the jobs that returned before their tasks ended

NATIVE = "sluice/quant/native"
SIZES = [2, 3, 1, 5, 17, 2, 64, 8, 4]  # tasks per job, in turn (1: the caller runs it alone)


@pytest.fixture
def c_threads():
    """pool.set_threads(n) for the test, back to one thread after it."""
    yield pool.set_threads
    pool.set_threads(1)


def run_check(jobs: int, sizes: list[int], spin: int = 0) -> torch.Tensor:
    """sluice_pool_check's counts, int64 [3, max(sizes)], after checking that no job returned early."""
    counts = torch.zeros(3, max(sizes), dtype=torch.int64)
    n = torch.tensor(sizes, dtype=torch.int64)
    early = LIB.sluice_pool_check(jobs, n.data_ptr(), len(sizes), counts.data_ptr(), counts.shape[1], spin)
    assert early == 0, f"{early} of {jobs} jobs returned before their tasks ended"
    return counts


def expected(jobs: int, sizes: list[int]) -> torch.Tensor:
    """The counts of every task run once with its own job's function and context (pool.c sluice_pool_check)."""
    want = torch.zeros(3, max(sizes), dtype=torch.int64)
    for k in range(jobs):
        want[k % 3, : sizes[k % len(sizes)]] += 1 << 20 if k % 2 else 1
    return want


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_each_task_of_many_short_jobs_runs_once_with_its_own_job(threads, c_threads):
    """20,000 jobs of 1-64 empty tasks back to back: workers wake late, spin, sleep, and find jobs over (more threads
    than the 2 cores: they are descheduled mid-job too); every task ran exactly once, as its own job's."""
    c_threads(threads)
    jobs = 20_000
    assert torch.equal(run_check(jobs, SIZES), expected(jobs, SIZES))


@pytest.mark.parametrize("threads", [2, 3])
def test_a_caller_waits_for_the_task_a_worker_still_runs(threads, c_threads):
    """Each task spins 40,000 pauses (longer than the caller's own wait): when the caller has run out of tasks it
    waits, spinning then asleep on the condition, for the one a worker still runs (no job returns early)."""
    c_threads(threads)
    jobs = 300
    assert torch.equal(run_check(jobs, [2, 3, 4], spin=40_000), expected(jobs, [2, 3, 4]))


def test_thread_count_changes_between_jobs(c_threads):
    """set_threads joins the old workers and the next job starts the new ones: counts exact across 1..4 and back."""
    for threads in (2, 4, 1, 3, 2, 1, 4):
        c_threads(threads)
        assert torch.equal(run_check(2_000, SIZES), expected(2_000, SIZES)), threads


def test_two_calling_threads_each_get_their_own_jobs(c_threads):
    """Two Python threads call at once (ctypes drops the GIL): one holds the pool, the other's jobs run on its own
    thread while it does; both counts exact."""
    c_threads(3)
    jobs, out = 10_000, {}

    def run(k: int) -> None:
        out[k] = run_check(jobs, SIZES[k:] + SIZES[:k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k in range(2):
        assert torch.equal(out[k], expected(jobs, SIZES[k:] + SIZES[:k])), k


def test_a_forked_child_starts_its_own_workers(c_threads):
    """After fork() the child has no workers and free locks (pthread_atfork): its jobs run, on new workers, exact."""
    c_threads(2)
    assert torch.equal(run_check(1_000, SIZES), expected(1_000, SIZES))  # the parent's workers are up
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only an exit code
        try:
            signal.alarm(60)
            ok = torch.equal(run_check(5_000, SIZES), expected(5_000, SIZES))
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert torch.equal(run_check(1_000, SIZES), expected(1_000, SIZES))  # and the parent's pool still runs


@pytest.mark.parametrize("path", [native.BEST, PORTABLE])
def test_kernels_over_many_short_jobs_keep_one_threads_bits(path, c_threads):
    """Real jobs (RMSNorm rows split over the pool), alternating shapes, 600 calls on 2-4 threads: each output is
    the one-thread output, bitwise."""
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 2048), (40, 512), (7, 1024), (130, 256), (3, 4096)]
    xs = [torch.randn(r, n, generator=g).bfloat16() for r, n in shapes]
    ws = [torch.randn(n, generator=g).bfloat16() for _, n in shapes]
    c_threads(1)
    want = [ops.rms_norm_bf16(x, w, 1e-6, path=path) for x, w in zip(xs, ws)]
    for threads in (2, 3, 4):
        c_threads(threads)
        for i in range(600):
            k = i % len(shapes)
            assert torch.equal(ops.rms_norm_bf16(xs[k], ws[k], 1e-6, path=path), want[k]), (threads, i)


def test_the_pool_under_thread_sanitizer(tmp_path):
    """pool.c alone with pool_tsan.c's driver (the check above on 1-8 threads, two callers), built with
    -fsanitize=thread: no data race reported, every count right. Skips where the compiler cannot build it."""
    root = Path(__file__).resolve().parents[2]
    exe = tmp_path / "pool_tsan"
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    sources = [str(Path(__file__).with_name("pool_tsan.c")), str(root / NATIVE / "pool.c")]
    build = subprocess.run([cc, "-O1", "-g", "-fsanitize=thread", "-std=gnu11", "-I", str(root / NATIVE), "-o",
                            str(exe), *sources, "-lpthread"], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"cannot build with -fsanitize=thread: {build.stderr.strip().splitlines()[-1:]}")
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    if "FATAL: ThreadSanitizer" in got.stderr:  # e.g. an address-space layout this TSan runtime refuses
        pytest.skip(f"ThreadSanitizer cannot run here: {got.stderr.strip().splitlines()[0]}")
    assert "ThreadSanitizer" not in got.stderr, got.stderr[-4000:]
    assert got.returncode == 0 and "wrong runs: 0" in got.stdout, (got.returncode, got.stdout, got.stderr[-2000:])
