"""`--memory auto` (the default): resident when the model fits in the memory this process may take, else streamed
with that room as the budget; a BudgetError that says what to do when not even one layer fits."""

from __future__ import annotations

import warnings

import pytest
import torch

import sluice
from sluice import cli
from sluice.errors import BudgetError, ConfigError, MemoryWarning
from sluice.options import format_bytes
from sluice.options import LoadOptions
from sluice.store.budget import RUNTIME_RESERVE, auto_memory
from sluice.host.memory import MemoryRoom

from ..models.tiny import hf_model, write_checkpoint

MiB = 2**20
IDS = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()


def test_fits_means_resident():
    plan = auto_memory(8 * 2**30, "MemAvailable", 100 * MiB, 10 * MiB, 64, 4, 50 * MiB)
    assert plan.memory is None
    assert "everything resident" in plan.describe() and "MemAvailable" in plan.describe()


def test_too_big_streams_with_the_room_less_kv_and_reserve():
    room = 2 * 2**30
    plan = auto_memory(room, "cgroup /x limit 2.0 GiB", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB)
    reserve = max(RUNTIME_RESERVE, room // 20)
    assert plan.memory == room - 50 * MiB - reserve
    assert "streaming" in plan.describe() and "cgroup /x" in plan.describe()


def test_what_the_process_holds_is_not_reserved_twice():
    """The room is net of what the process holds already (torch, Python): only the rest of the runtime reserve is
    still to come, and the budget gets the difference; the description says the footprint."""
    room, held = 1536 * MiB, 200 * MiB
    plan = auto_memory(room, "cgroup /x limit 1.5 GiB", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB, held=held)
    reserve = max(RUNTIME_RESERVE - held, room // 20)
    assert plan.memory == room - 50 * MiB - reserve and plan.reserve == reserve < RUNTIME_RESERVE
    assert auto_memory(room, "x", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB).memory == room - 50 * MiB - RUNTIME_RESERVE
    assert f"KV cache of 50.0 MiB and {format_bytes(reserve)} more for the runtime (200.0 MiB already held)" \
        in plan.describe()
    # a model that fits only once the double count is gone is resident
    fits = (room - 50 * MiB - reserve - 100 * MiB) // (10 * MiB)
    assert auto_memory(room, "x", 100 * MiB, 10 * MiB, fits, 4, 50 * MiB, held=held).memory is None
    assert auto_memory(room, "x", 100 * MiB, 10 * MiB, fits, 4, 50 * MiB).memory is not None


def test_no_room_for_one_layer_says_what_to_do():
    with pytest.raises(BudgetError) as e:
        auto_memory(300 * MiB, "cgroup /bench limit 300.0 MiB", 100 * MiB, 10 * MiB, 640, 8, 20 * MiB)
    msg = str(e.value)
    assert "cgroup /bench" in msg and "300.0 MiB available" in msg
    assert "--max-context" in msg and "--memory" in msg
    # the smallest room that works: resident + top_k experts + KV + reserve
    assert "456.0 MiB" in msg  # 100 + 8 * 10 + 20 + 256 (300 // 20 < 256: the reserve is the floor)


@pytest.mark.parametrize("given,expected", [("auto", "auto"), (" Auto ", "auto"), ("all", None), ("ALL", None),
                                            (None, None), ("1GiB", 2**30), (4096, 4096)])
def test_memory_option_values(given, expected):
    assert LoadOptions.make(memory=given).memory == expected


def test_memory_option_default_is_auto_and_bad_values_name_the_choices():
    assert LoadOptions().memory == "auto"
    with pytest.raises(ConfigError, match="auto, all, or a size"):
        LoadOptions.make(memory="lots")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("auto"), "per_expert")


@pytest.fixture(scope="module")
def resident(model_dir):
    with sluice.load(model_dir, memory="all") as m:
        return list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)), m.resident_bytes, m.layout.expert_nbytes


def _room(monkeypatch, nbytes: int) -> None:
    """The room the plan sees; and nothing held yet, so that the whole RUNTIME_RESERVE is still to come (the test
    process's own memory would otherwise decide how much of it the plan counts)."""
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(nbytes, "cgroup /test limit"))
    real = sluice.plan.memory_status
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {**real(), "rss_anon_bytes": 0})


def test_auto_loads_resident_when_it_fits(model_dir, resident, monkeypatch):
    _room(monkeypatch, 16 * 2**30)
    with sluice.load(model_dir) as m:
        assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == resident[0]
        st = m.stats()
    assert st["memory"] is None and st["memory_plan"].startswith("auto: everything resident")
    assert st["misses"] == 0


def test_auto_streams_when_it_does_not_fit_with_identical_tokens(model_dir, resident, monkeypatch):
    tokens, resident_bytes, expert = resident
    with sluice.load(model_dir, memory="all") as m:
        kv = m.cache.nbytes
    room = RUNTIME_RESERVE + kv + resident_bytes + 3 * expert + expert // 2  # room for 3 of the 16 experts
    _room(monkeypatch, room)
    with sluice.load(model_dir) as m:
        assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens
        st = m.stats()
    assert st["memory"] == room - kv - RUNTIME_RESERVE
    assert "streaming" in st["memory_plan"] and "cgroup /test" in st["memory_plan"]
    assert st["misses"] > 0 and st["slots"] == 3


def test_auto_without_room_fails_before_loading(model_dir, monkeypatch):
    _room(monkeypatch, RUNTIME_RESERVE)
    with pytest.raises(BudgetError, match="not enough memory for this model"):
        sluice.load(model_dir)


@pytest.mark.parametrize("room,forced,expected", [("roomy", None, False), ("tight", None, True),
                                                  ("tight", False, False), ("roomy", True, True)])
def test_odirect_auto_when_page_cache_could_not_hold_the_experts(model_dir, resident, monkeypatch, room, forced,
                                                                   expected):
    """odirect None (the default): O_DIRECT only when streaming and the experts exceed the room left beside the
    budget; an explicit True/False wins. Tokens are the same either way."""
    tokens, resident_bytes, expert = resident
    memory = resident_bytes + 4 * expert
    with sluice.load(model_dir, memory="all") as m:
        experts = len(m.layout.layers) * m.spec.num_experts * expert
        kv = m.cache.nbytes
    # beside the budget, the KV cache and the runtime reserve: room for half the experts, or for all twice
    _room(monkeypatch, memory + kv + RUNTIME_RESERVE + (experts // 2 if room == "tight" else 2 * experts))
    with sluice.load(model_dir, memory=memory, io="direct", odirect=forced) as m:
        assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens
        assert m.odirect is expected and m.stats()["odirect"] is expected


def test_odirect_auto_is_off_when_resident(model_dir, monkeypatch):
    _room(monkeypatch, 16 * 2**30)
    with sluice.load(model_dir, io="direct") as m:
        assert m.memory is None and m.odirect is False


def test_memory_all_above_a_cgroup_limit_is_refused_before_loading(model_dir, resident, monkeypatch):
    """--memory all used to be OOM-killed with no message inside a cgroup that cannot hold the model."""
    _, resident_bytes, expert = resident
    with sluice.load(model_dir, memory="all") as m:
        kv = m.cache.nbytes
    _room(monkeypatch, resident_bytes // 2)
    with pytest.raises(BudgetError, match=r"--memory all .* would be killed .* no budget fits"):
        sluice.load(model_dir, memory="all")
    _room(monkeypatch, resident_bytes + 4 * expert + kv)  # a streaming budget fits: it is named
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {"rss_anon_bytes": RUNTIME_RESERVE})  # all held
    with pytest.raises(BudgetError, match=r"--memory all .* would be killed .* largest budget that fits .* auto"):
        sluice.load(model_dir, memory="all")


def test_explicit_budget_above_a_cgroup_limit_is_refused(model_dir, resident, monkeypatch):
    _, resident_bytes, expert = resident
    _room(monkeypatch, resident_bytes + 2 * expert)
    with pytest.raises(BudgetError, match=r"--memory .* keeps .* only .* available \(cgroup /test limit\)"):
        sluice.load(model_dir, memory=resident_bytes + 8 * expert)


def test_budget_that_fits_under_a_cgroup_limit_but_not_beside_the_runtime_is_refused(model_dir, resident,
                                                                                    monkeypatch, capsys):
    """`sluice run BIG --memory 300MiB` in a 512 MiB cgroup (360 MiB available, 297 MiB weights + ~104 MiB runtime)
    warned, then thrashed: 16 GB re-read in 50 s. It is refused as auto refuses, naming the largest budget that fits."""
    _, resident_bytes, expert = resident
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {"rss_anon_bytes": 0})  # all of the reserve to come
    with sluice.load(model_dir, memory="all") as m:
        kv = m.cache.nbytes
    smallest = resident_bytes + 2 * expert  # top_k 2
    room = kv + RUNTIME_RESERVE + smallest + 3 * expert  # beside the KV cache and the runtime: 5 expert slots
    _room(monkeypatch, room)
    memory = resident_bytes + 8 * expert  # fits in the room, not beside the runtime
    with pytest.raises(BudgetError, match=rf"thrash .* The largest budget that fits is --memory {smallest + 3 * expert};"):
        sluice.load(model_dir, memory=memory)
    with sluice.load(model_dir, memory=smallest + 3 * expert) as m:  # the figure named works
        assert m.stats()["slots"] == 5
    assert cli.main(["run", str(model_dir), "--prompt", "x", "--memory", str(memory)]) == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, no warning before it
    assert line.startswith(f"sluice run: error: --memory {format_bytes(memory)} keeps") and "cgroup /test" in line
    # when not even the smallest budget fits beside them, that is said instead
    _room(monkeypatch, smallest + kv)
    with pytest.raises(BudgetError, match="no budget fits: the smallest that runs"):
        sluice.load(model_dir, memory=memory)


def test_the_largest_budget_is_shown_in_whole_mib_that_fit():
    from sluice.store.budget import check_room

    # the 512 MiB cgroup: 360 MiB available, 104 MiB of the runtime still to come
    room, held, source = 360 * MiB + MiB // 2, RUNTIME_RESERVE - 104 * MiB, "cgroup /sys/fs/cgroup/x limit 512.0 MiB"
    with pytest.raises(BudgetError, match=r"thrash .* The largest budget that fits is --memory 256MiB;"):
        check_room(300 * MiB, room, source, 200 * MiB, MiB, 10**6, 0, held=held)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_room(256 * MiB, room, source, 200 * MiB, MiB, 10**6, 0, held=held)


def test_budget_above_mem_available_warns_and_runs(model_dir, resident, monkeypatch):
    """MemAvailable is not a hard limit (others may free memory, or swap): a warning, and the run goes on."""
    tokens, resident_bytes, _ = resident
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(resident_bytes, "MemAvailable"))
    with pytest.warns(MemoryWarning, match="MemAvailable"):
        with sluice.load(model_dir, memory="all") as m:
            assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens


def test_budget_that_fits_says_nothing(model_dir, monkeypatch):
    _room(monkeypatch, 16 * 2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sluice.load(model_dir, memory="all").close()


def test_the_reserve_counts_what_the_process_already_holds():
    """The room is already net of this process's memory (a cgroup's limit minus its usage, or MemAvailable): a
    budget that leaves the rest of the reserve says nothing; one that does not is refused under a cgroup limit and
    warned about under MemAvailable."""
    from sluice.store.budget import RUNTIME_RESERVE, check_room

    MiB = 2**20
    weights, kv = 640 * MiB, 64 * MiB
    room = weights + kv + RUNTIME_RESERVE // 2  # a 1 GiB cgroup after ~160 MiB of torch and Python
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_room(weights, room, "cgroup /test limit", 0, MiB, 10**6, kv, held=RUNTIME_RESERVE // 2)
    with pytest.raises(BudgetError, match="more for the runtime"):
        check_room(weights, room, "cgroup /test limit", 0, MiB, 10**6, kv, held=0)
    with pytest.warns(MemoryWarning, match="more for the runtime"):
        check_room(weights, room, "MemAvailable", 0, MiB, 10**6, kv, held=0)


def test_an_explicit_prefill_chunk_is_out_of_the_room_before_the_budget():
    """An explicit --prefill-chunk's passes are counted before auto's budget (they were not, and --prefill-chunk 1024
    at a 1 GiB ceiling was OOM-killed): the budget shrinks by them, the description says so, and a chunk that leaves
    no room for one layer is the BudgetError naming it."""
    room, acts = 1536 * MiB, 80 * MiB
    plain = auto_memory(room, "cgroup /x limit 1.5 GiB", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB)
    chunked = auto_memory(room, "cgroup /x limit 1.5 GiB", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB, activations=acts)
    assert chunked.memory == plain.memory - acts
    assert "80.0 MiB for --prefill-chunk's passes" in chunked.describe()
    assert "--prefill-chunk" not in plain.describe()
    with pytest.raises(BudgetError, match="for --prefill-chunk's passes \\(lower it\\)"):
        auto_memory(400 * MiB, "cgroup /x limit 400 MiB", 100 * MiB, 10 * MiB, 640, 4, 20 * MiB,
                    activations=250 * MiB)


def test_a_streamed_prompt_keeps_room_for_its_passes_where_the_budget_can_spare_it():
    """Auto's own chunk, streamed: the budget gives up `prompt` bytes (STREAMED_PROMPT_TOKENS tokens' passes) where
    it still holds one layer's top_k experts beside them, and not where it would not; a resident fit ignores it."""
    room, prompt = 1536 * MiB, 80 * MiB
    plain = auto_memory(room, "x", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB)
    kept = auto_memory(room, "x", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB, prompt=prompt)
    assert kept.memory == plain.memory - prompt and kept.prompt == prompt
    assert "80.0 MiB for a prompt's passes" in kept.describe()
    tight = 100 * MiB + 4 * 10 * MiB + 50 * MiB + RUNTIME_RESERVE + 10 * MiB  # one layer's slots and 10 MiB more
    squeezed = auto_memory(tight, "x", 100 * MiB, 10 * MiB, 640, 4, 50 * MiB, prompt=prompt)
    assert squeezed.prompt == 0 and squeezed.memory == auto_memory(tight, "x", 100 * MiB, 10 * MiB, 640, 4,
                                                                   50 * MiB).memory
    fits = auto_memory(8 * 2**30, "x", 100 * MiB, 10 * MiB, 64, 4, 50 * MiB, prompt=prompt)
    assert fits.memory is None


def test_the_default_expert_reader_is_the_io_uring_16_deep_where_allowed(model_dir, resident, refuse_io_uring):
    """--io direct with --io-engine auto and --io-workers 0: the io_uring with URING_DEPTH reads in flight where the
    kernel allows it, else preader.c's DEFAULT_WORKERS threads (a refused io_uring: EPERM here); an explicit
    --io-workers wins; the tokens are the same on each."""
    from sluice.io import DEFAULT_WORKERS, native_pool
    from sluice.io.engines import URING_DEPTH

    tokens, resident_bytes, expert = resident
    memory = resident_bytes + 4 * expert
    if not native_pool.available():
        pytest.skip("the native reader (io/preader.c) is not built: the Python threads read (tests/io covers them)")
    with sluice.load(model_dir, memory=memory, io="direct", io_workers=4) as m:
        assert m.reader.workers == 4 and list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens
    if native_pool.uring_error() is None:
        with sluice.load(model_dir, memory=memory, io="direct") as m:
            assert (m.reader.engine, m.reader.workers) == ("uring", URING_DEPTH)
            assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens
    refuse_io_uring()
    with sluice.load(model_dir, memory=memory, io="direct") as m:
        assert (m.reader.engine, m.reader.workers) == ("native", DEFAULT_WORKERS)
        assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens
