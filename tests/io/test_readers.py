"""Every reader returns the file's exact bytes, for every awkward range shape; errors name the file; pools stop."""

from __future__ import annotations

import errno
import os
import random
import threading
import warnings

import pytest
import torch

from sluice.errors import CheckpointError, ConfigError, ModelFileWarning
from sluice.io import DirectReader, MmapReader, WillneedReader, make_reader, native_pool
from sluice.io.engines import resolve_engine
from sluice.io.base import FileGuard
from sluice.io.mapped import merged_page_windows
from sluice.io.ranges import MIN_SPLIT, ReadRange, page_window, plan_reads, split_even

SIZE = 5 * 4096 * 64 + 1234  # ~1.3 MB, deliberately not a page multiple

READERS = {
    "mmap": lambda: make_reader("mmap"),
    "willneed": lambda: make_reader("willneed"),
    **{f"direct-w{w}{'-odirect' if o else ''}-{e}": (lambda w=w, o=o, e=e: make_reader("direct", workers=w, odirect=o,
                                                                                          engine=e))
       for e in ("native", "uring", "python") for o in (False, True) for w in (1, 4)},
}


@pytest.fixture(params=list(READERS))
def reader(request):
    if request.param.endswith("-uring") and (why := native_pool.uring_error()):
        pytest.skip(why)
    r = READERS[request.param]()
    yield r
    r.close()


@pytest.fixture
def data_file(random_file):
    return random_file(SIZE, 1)


def req(path: str, offset: int, nbytes: int) -> tuple[ReadRange, torch.Tensor]:
    return ReadRange(path, offset, nbytes), torch.empty(nbytes, dtype=torch.uint8)


def check(requests, data: bytes) -> None:
    for rng, dest in requests:
        assert dest.numpy().tobytes() == data[rng.offset : rng.end], rng


def awkward_requests(path: str, seed: int) -> list:
    rnd = random.Random(seed)
    reqs = []
    for _ in range(120):  # random: unaligned starts, lengths not multiples of 4096
        off = rnd.randrange(SIZE)
        reqs.append(req(path, off, rnd.randrange(0, min(200_000, SIZE - off) + 1)))
    reqs.append(req(path, SIZE - 777, 777))  # ends exactly at EOF
    reqs.append(req(path, 0, SIZE))  # the whole file
    reqs.append(req(path, 4096 * 10 + 3, 0))  # zero-length
    reqs += [req(path, 5000, 3000), req(path, 5000, 3000), req(path, 5000, 3000)]  # duplicates
    reqs += [req(path, 100_000 + 1000 * i, 1000) for i in range(5)]  # exactly adjacent
    reqs += [req(path, 300_000, 9000), req(path, 304_000, 9000), req(path, 300_000, 20000)]  # overlapping
    rnd.shuffle(reqs)
    return reqs


def test_awkward_ranges_match_file(reader, data_file):
    path, data = data_file
    reqs = awkward_requests(path, 0)
    reader.read(reqs)
    check(reqs, data)
    reqs = awkward_requests(path, 1)
    reader.submit(reqs).result(timeout=30)
    check(reqs, data)
    s = reader.stats()
    assert s["dedup_saved_bytes"] >= 2 * 3000 * 2
    assert s["wait_s"] >= 0 and s["requests"] > 0


def test_sparse_ranges_with_gaps(reader, data_file):
    path, data = data_file
    rnd = random.Random(5)
    reqs = [req(path, off, rnd.randrange(1, 5000)) for off in range(7, SIZE - 5000, 37_000)]
    reader.read(reqs)
    check(reqs, data)


def test_empty_request_list(reader):
    reader.read([])
    assert reader.submit([]).result(timeout=10) is None


def test_adjacent_ranges_are_coalesced(reader, data_file):
    path, data = data_file
    reqs = [req(path, 10_001 + 700 * i, 700) for i in range(4)]
    reader.read(reqs)
    check(reqs, data)
    s = reader.stats()
    assert (s["reads"], s["coalesced"]) == (1, 3)


def test_duplicates_read_once(reader, data_file):
    path, data = data_file
    reqs = [req(path, 4097, 9000) for _ in range(3)]
    reader.read(reqs)
    check(reqs, data)
    s = reader.stats()
    assert s["dedup_saved_bytes"] == 2 * 9000 and s["bytes_read"] == 9000 and s["reads"] == 1


def test_memoryview_destination(reader, data_file):
    path, data = data_file
    buf = bytearray(5000)
    reader.read([(ReadRange(path, 123, 5000), memoryview(buf))])
    assert bytes(buf) == data[123:5123]


def test_wrong_destination_size(reader, data_file):
    path, _ = data_file
    with pytest.raises(ValueError, match="5000"):
        reader.read([(ReadRange(path, 0, 5000), torch.empty(4000, dtype=torch.uint8))])


@pytest.mark.parametrize("offset,nbytes", [(SIZE - 100, 101), (SIZE + 10, 5), (SIZE - 5000, 20_000)])
def test_range_past_eof_names_file(reader, data_file, offset, nbytes):
    path, data = data_file
    with pytest.raises(CheckpointError) as e:
        reader.read([req(path, 0, 10), req(path, offset, nbytes)])
    assert e.value.file == path and path in str(e.value)
    ok = [req(path, 50, 60_000)]  # the reader is still usable
    reader.read(ok)
    check(ok, data)


@pytest.mark.parametrize("odirect", [False, True])
def test_direct_short_read_reports_range_and_size(data_file, odirect, io_engine):
    """The message names the range being read (offset and length) and the file's size, not the file's end as the
    offset (issue 12, item 9)."""
    path, _ = data_file
    with DirectReader(1, odirect=odirect, engine=io_engine) as r:
        with pytest.raises(CheckpointError) as e:
            r.read([req(path, 0, 10), req(path, SIZE - 100, 5000)])
    msg = str(e.value)
    assert f"5000 bytes at offset {SIZE - 100}" in msg and f"file has {SIZE} bytes" in msg, msg


def test_changed_file_is_refused_before_the_batch(reader, data_file):
    """Rewritten in place (same size) after the reader opened it: the fstat before the next batch sees the new
    mtime. Without it the reader would return the new bytes as if the header still described them."""
    path, _ = data_file
    reader.read([req(path, 0, 100)])  # opens / maps the file and records its version
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(CheckpointError, match="rewritten in place") as e:
        reader.submit([req(path, 0, 100)]).result(timeout=10)
    assert e.value.file == path


def test_expected_stamp_refuses_a_replaced_file(reader, data_file):
    """A stamp handed to expect() (the header's) refuses a file replaced before the reader first opens it."""
    from sluice.checkpoint.ref import FileStamp

    path, data = data_file
    reader.expect([FileStamp.of(path, os.stat(path))])
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # same bytes, another inode: still not the file the header was read from
    with pytest.raises(CheckpointError, match="replaced by another file") as e:
        reader.submit([req(path, 0, 100)]).result(timeout=10)
    assert e.value.file == path


def test_submit_each_fills_each_batch_on_its_own_future(reader, data_file):
    """submit_each: one future per batch, in order, each holding its own batch's bytes (the streaming store queues a
    layer's missed experts this way, one batch each)."""
    path, data = data_file
    batches = [awkward_requests(path, seed)[:20] for seed in range(4)] + [[]]
    futures = reader.submit_each(batches)
    assert len(futures) == len(batches)
    for fut, batch in zip(futures, batches):
        assert fut.result(timeout=30) is None
        check(batch, data)


def test_submit_each_refuses_a_changed_file_in_every_batch(reader, data_file):
    """A file rewritten in place since it was opened fails every batch of the call, each with the error naming it."""
    path, _ = data_file
    reader.read([req(path, 0, 100)])
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    for fut in reader.submit_each([[req(path, 0, 100)], [req(path, 5000, 100)], [req(path, 9000, 10)]]):
        with pytest.raises(CheckpointError, match="rewritten in place") as e:
            fut.result(timeout=10)
        assert e.value.file == path


def test_direct_submit_each_checks_each_file_once(data_file, tmp_path, monkeypatch):
    """The direct reader checks each file once per submit_each call, not once per batch: a streamed decode step
    then pays one fstat per layer, where it paid one per missed expert."""
    path, data = data_file
    other = tmp_path / "other.bin"
    other.write_bytes(data[:50_000])
    checked: list[str] = []
    real = FileGuard.check

    def counting(self, p, fd):
        checked.append(p)
        return real(self, p, fd)

    monkeypatch.setattr(FileGuard, "check", counting)
    with DirectReader(workers=2, odirect=True) as r:
        batches = [[req(path, 1000 * i, 700), req(str(other), 3000 * i, 900)] for i in range(6)]
        for fut in r.submit_each(batches):
            fut.result(timeout=30)
        assert sorted(checked) == sorted([path, str(other)])
        for batch in batches:
            check(batch[:1], data)
            check(batch[1:], data[:50_000])
        r.submit(batches[0]).result(timeout=30)  # submit is a call of its own: its files are checked again
        assert len(checked) == 4


def test_missing_file_names_file(reader, tmp_path):
    path = str(tmp_path / "nope.bin")
    with pytest.raises(CheckpointError) as e:
        reader.read([req(path, 0, 10)])
    assert e.value.file == path


def test_truncated_after_open_raises(reader, data_file):
    """Truncation in place after the file was opened/mapped: CheckpointError, no hang, no SIGBUS."""
    path, data = data_file
    reader.read([req(path, 0, 100)])  # opens / maps the file
    os.truncate(path, SIZE // 2)
    fut = reader.submit([req(path, SIZE // 2 + 10, 5000)])
    with pytest.raises(CheckpointError) as e:
        fut.result(timeout=10)
    assert e.value.file == path


@pytest.mark.parametrize("make", [MmapReader, lambda: DirectReader(2), lambda: DirectReader(2, odirect=True)])
@pytest.mark.parametrize("how", ["replace", "remove"])
def test_replaced_or_removed_file_keeps_old_bytes_and_warns_once(data_file, make, how, monkeypatch):
    """A reader keeps the inode it opened, so a file replaced at the same path (or removed) reads the old bytes,
    which are the ones its header described; the path no longer naming it is said once (it was not noticed)."""
    monkeypatch.setattr("sluice.io.base.PATH_CHECK_S", 0.0)  # look the path up at every batch
    path, data = data_file
    with make() as r:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r.read([req(path, 0, 10)])
        os.unlink(path)
        if how == "replace":
            with open(path, "wb") as f:
                f.write(b"\0" * SIZE)
        reqs = [req(path, 1000, 50_000)]
        what = "was replaced by another file" if how == "replace" else "was removed or renamed away"
        with pytest.warns(ModelFileWarning, match=f"file {path} {what} after it was opened; this run goes on"):
            r.read(reqs)
        check(reqs, data)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per file
            r.read(reqs)


def io_threads(engine: str) -> list:
    """The reader's threads: the Python reader's by their names, preader.c's (no Python object) by their OS names
    (pthread_setname_np). Counting every OS thread of the process failed once in a full run: 13 where 12 were
    expected, a thread of something else starting meanwhile."""
    if engine != "python":
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except FileNotFoundError:  # a thread that ended between listdir and open
                pass
        return [n for n in names if n.startswith("sluice-io-")]
    return [t for t in threading.enumerate() if t.name.startswith("sluice-io-")]


def test_pool_threads_stop_on_close(data_file, io_engine):
    """4 workers: 4 threads, or the io_uring's one (4 reads in flight); none left after close()."""
    path, data = data_file
    engine = io_engine
    before = len(io_threads(engine))
    r = DirectReader(workers=4, engine=engine)
    assert r.stats()["engine"] == engine
    assert len(io_threads(engine)) == before + (1 if engine == "uring" else 4)
    reqs = [req(path, 0, SIZE)]
    fut = r.submit(reqs)
    r.close()  # queued work finishes first
    assert fut.done()
    check(reqs, data)
    assert len(io_threads(engine)) == before
    with pytest.raises(RuntimeError):
        r.read(reqs)
    r.close()  # idempotent


def test_large_range_is_spread_over_workers(data_file, monkeypatch):
    path, data = data_file
    monkeypatch.setattr("sluice.io.ranges.MIN_SPLIT", 64 * 1024)  # the file is ~1.3 MB: let it split in 4
    with DirectReader(workers=4) as r:
        reqs = [req(path, 3, SIZE - 3)]
        r.read(reqs)
        check(reqs, data)
        assert r.stats()["reads"] >= 4  # cut at page-aligned absolute offsets: 4-5 pieces


def test_odirect_falls_back_when_refused(data_file, monkeypatch):
    path, data = data_file
    real_open = os.open

    def no_odirect(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr("sluice.io.direct.os.open", no_odirect)
    with DirectReader(workers=2, odirect=True) as r:
        reqs = awkward_requests(path, 3)
        r.read(reqs)
        check(reqs, data)
        assert r.stats()["odirect_fallback"] is True


def test_faults_are_counted_per_thread(data_file):
    path, _ = data_file
    with MmapReader() as r:
        r.read([req(path, 0, SIZE)])
        s = r.stats()
        assert s["major_faults"] + s["minor_faults"] > 0 and threading.current_thread().name in s["threads"]


def test_willneed_hints_unaligned_ranges(data_file):
    """mmap.madvise rejects an unaligned start, so this passing shows the hints are aligned (and clamped at EOF)."""
    path, data = data_file
    with WillneedReader() as r:
        reqs = [req(path, 4097, 10), req(path, SIZE - 3, 3), req(path, 8191, 2)]
        fut = r.submit(reqs)
        assert not fut.done()  # documented: the copy is deferred to result()
        fut.result()
        assert fut.done()
        check(reqs, data)


def test_make_reader_unknown_mode():
    with pytest.raises(ValueError, match="mmap, willneed, direct"):
        make_reader("uring")


# --- pure functions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset,nbytes,size,expected",
    [
        (0, 1, 100_000, (0, 4096)),
        (4095, 2, 100_000, (0, 8192)),  # straddles a page: both pages
        (4096, 4096, 100_000, (4096, 4096)),  # aligned stays as is
        (5000, 100, 100_000, (4096, 4096)),
        (99_000, 1000, 100_000, (98_304, 1696)),  # end clamped to the file size
        (200_000, 10, 100_000, (196_608, 0)),  # wholly past EOF: nothing
    ],
)
def test_page_window(offset, nbytes, size, expected):
    assert page_window(offset, nbytes, size) == expected


def test_merged_page_windows():
    assert merged_page_windows([(5000, 10), (100, 10), (8192, 1), (20_000, 0)], 10_000) == [(0, 10_000)]
    assert merged_page_windows([(0, 10), (20_478, 5)], 30_000) == [(0, 4096), (16_384, 8192)]


def test_plan_dedup_coalesce_overlap():
    buf = lambda n: torch.empty(n, dtype=torch.uint8)  # noqa: E731
    reqs = [
        (ReadRange("b", 0, 10), buf(10)),
        (ReadRange("a", 100, 50), buf(50)),
        (ReadRange("a", 100, 50), buf(50)),  # duplicate
        (ReadRange("a", 150, 50), buf(50)),  # adjacent
        (ReadRange("a", 190, 50), buf(50)),  # overlapping
        (ReadRange("a", 10_000, 5), buf(5)),  # gap 9760 <= max_gap
        (ReadRange("a", 500_000, 5), buf(5)),  # far: own read
        (ReadRange("a", 7, 0), buf(0)),  # empty: dropped
    ]
    plan = plan_reads(reqs, max_gap=64 * 1024)
    assert [(r.path, r.offset, r.nbytes) for r in plan.reads] == [("a", 100, 9905), ("a", 500_000, 5), ("b", 0, 10)]
    assert plan.reads[0].overlapping and not plan.reads[1].overlapping
    assert (plan.requests, plan.dedup_saved_bytes, plan.coalesced) == (7, 50, 3)
    assert len(plan.reads[0].segments[0].dests) == 2


def test_plan_without_overlap_is_zero_copy():
    reqs = [(ReadRange("a", o, 10), torch.empty(10, dtype=torch.uint8)) for o in (0, 10, 30)]
    (read,) = plan_reads(reqs).reads
    gap = memoryview(bytearray(64))
    assert [len(b) for b in read.iovecs(gap)] == [10, 10, 10, 10]  # dest, dest, 10-byte gap, dest


def test_plan_splits_for_workers():
    big = 4 * MIN_SPLIT
    reqs = [(ReadRange("a", 1, big), torch.empty(big, dtype=torch.uint8))]
    plan = plan_reads(reqs, parts=4)
    assert len(plan.reads) == 5 and sum(r.nbytes for r in plan.reads) == big  # cut on page-aligned offsets
    assert all(r.end % 4096 == 0 for r in plan.reads[:-1])
    chunks = split_even(plan.reads, 4)
    assert len(chunks) == 4 and [r for c in chunks for r in c] == plan.reads
    assert split_even([], 4) == []


def test_refused_io_uring_is_one_clear_error(refuse_io_uring):
    """A kernel or a seccomp filter that refuses io_uring (EPERM here): the reader says why and what to use."""
    if not native_pool.available():
        pytest.skip("the native reader (io/preader.c) is not built")
    refuse_io_uring()
    assert "Operation not permitted" in native_pool.uring_error()
    with pytest.raises(RuntimeError, match=r"io_uring reader could not start: Operation not permitted.*--io-engine "
                                           r"native") as refused:
        DirectReader(2, engine="uring")
    assert isinstance(refused.value, ConfigError)  # the CLI's one `error:` line (exit 2), not an internal error


def test_auto_engine_is_the_io_uring_where_allowed_else_the_threads(refuse_io_uring, tmp_path):
    """--io-engine auto (io/direct.py resolve_engine): the io_uring where this process may open one, preader.c's
    threads where it is refused (a seccomp filter: EPERM here) and for the row tables' reader (uring=False), the
    Python threads where nothing is built; the same bytes land either way."""
    if not native_pool.available():
        assert resolve_engine("auto") == "python" and DirectReader(2).engine == "python"
        pytest.skip("the native reader (io/preader.c) is not built: auto is the Python threads (checked)")
    path = tmp_path / "f.bin"
    data = torch.randint(0, 256, (3 * 4096 + 77,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())

    def read_with(reader: DirectReader) -> torch.Tensor:
        out = torch.empty(5000, dtype=torch.uint8)
        with reader:
            reader.read([(ReadRange(str(path), 4000, 5000), out)])
        return out

    assert resolve_engine("native") == "native" and resolve_engine("python", uring=False) == "python"
    assert resolve_engine("auto", uring=False) == "native"
    if (why := native_pool.uring_error()) is None:
        r = DirectReader(2)
        assert r.engine == "uring" and r.stats()["engine"] == "uring"
        assert torch.equal(read_with(r), data[4000:9000])
    else:
        assert resolve_engine("auto") == "native", why
    refuse_io_uring()
    assert resolve_engine("auto") == "native"
    r = DirectReader(2)
    assert r.engine == "native"
    assert torch.equal(read_with(r), data[4000:9000])
