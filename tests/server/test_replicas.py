"""Replica sizing (server/replicas.py) and the --ray flags' checks: arithmetic and argument errors, no Ray started."""

from __future__ import annotations

import importlib.util

import pytest

from sluice import cli
from sluice.errors import BudgetError, ConfigError
from sluice.server.replicas import RAY_PROCESSES, REPLICA_PROCESS, ModelNeed, Node, parse_replicas, size_replicas
from sluice.store.budget import RUNTIME_RESERVE

MiB, GiB = 2**20, 2**30
# a model of 100 MiB resident weights and 64 experts of 8 MiB over its layers (top-2), a 16 MiB KV cache: 628 MiB
# resident in all, 1,380 MiB with the runtime reserve and the replica's process
NEED = ModelNeed(resident_bytes=100 * MiB, expert_bytes=8 * MiB, total_experts=64, top_k=2, kv_bytes=16 * MiB)
RESIDENT = 100 * MiB + 64 * 8 * MiB + 16 * MiB + RUNTIME_RESERVE + REPLICA_PROCESS
PLAN = RESIDENT - REPLICA_PROCESS  # what the load plan counts


def node(cpus: int, room: int) -> Node:
    """A node whose room for replicas (beside Ray's own processes) is `room` bytes."""
    return Node(cpus, room + RAY_PROCESSES)


def test_a_replica_takes_its_kept_weights_kv_cache_runtime_and_process():
    assert NEED.bytes_at(None) == RESIDENT
    # a 300 MiB budget keeps the resident weights and (300 - 100) / 8 = 25 expert slots
    assert NEED.bytes_at(300 * MiB) == 100 * MiB + 25 * 8 * MiB + 16 * MiB + RUNTIME_RESERVE + REPLICA_PROCESS


def test_auto_is_what_the_cpus_and_the_memory_of_each_node_hold():
    # CPU-bound: 2 CPUs, room for 10 resident replicas
    s = size_replicas(NEED, [node(2, 10 * RESIDENT)], "auto", 0, "auto")
    assert (s.replicas, s.threads, s.memory, s.need) == (2, 1, None, RESIDENT)
    # memory-bound: 16 CPUs, room for 3 (not 4)
    s = size_replicas(NEED, [node(16, 4 * RESIDENT - 1)], "auto", 0, "auto")
    assert (s.replicas, s.threads) == (3, 1)
    # each node filled on its own: 2 + 3, not (2 + 16) CPUs for (10 + 3.99) replicas' memory pooled
    s = size_replicas(NEED, [node(2, 10 * RESIDENT), node(16, 4 * RESIDENT - 1)], "auto", 0, "auto")
    assert s.replicas == 5 and "2 nodes" in s.why
    # --threads 4: 16 CPUs hold 4 of them
    assert size_replicas(NEED, [node(16, 10 * RESIDENT)], "auto", 4, "auto").replicas == 4


def test_auto_streams_one_replica_a_node_when_the_model_does_not_fit_resident():
    room = REPLICA_PROCESS + PLAN // 2  # half the plan's figure: stream with that room as the budget
    s = size_replicas(NEED, [node(8, room), node(8, room)], "auto", 0, "auto")
    assert s.replicas == 2 and s.memory is not None and s.memory < RESIDENT and s.need <= room


def test_explicit_budget_and_all_are_each_replicas():
    s = size_replicas(NEED, [node(4, 10 * GiB)], 3, 1, 300 * MiB)
    assert (s.replicas, s.memory, s.need) == (3, 300 * MiB, NEED.bytes_at(300 * MiB))
    s = size_replicas(NEED, [node(4, 10 * GiB)], 2, 0, None)
    assert (s.replicas, s.threads, s.memory, s.need) == (2, 2, None, RESIDENT)  # the 4 CPUs shared out


def test_a_count_shares_the_node_memory_under_auto():
    # two replicas on one node whose room holds one resident model but not two: each streams with half the room
    s = size_replicas(NEED, [node(2, RESIDENT + RESIDENT // 2)], 2, 0, "auto")
    assert s.replicas == 2 and s.threads == 1 and s.memory is not None and 2 * s.need <= RESIDENT + RESIDENT // 2
    # one replica there: everything resident
    assert size_replicas(NEED, [node(2, RESIDENT + RESIDENT // 2)], 1, 0, "auto").memory is None


def test_a_count_the_cluster_cannot_hold_says_how_many_fit():
    with pytest.raises(ConfigError) as e:
        size_replicas(NEED, [node(2, 10 * RESIDENT)], 3, 1, None)
    assert "--replicas 3" in str(e.value) and "holds 2; use --replicas 2 or auto" in str(e.value)
    with pytest.raises(ConfigError, match="not one replica of 1 thread and .* fits in 1 node"):
        size_replicas(NEED, [node(2, RESIDENT - 1)], "auto", 0, None)
    with pytest.raises(ConfigError, match="no node with CPUs"):
        size_replicas(NEED, [Node(0, 64 * GiB)], "auto", 0, "auto")


def test_a_share_too_small_for_one_replica_names_the_smallest_room():
    with pytest.raises(BudgetError) as e:
        size_replicas(NEED, [node(8, 2 * GiB)], 4, 1, "auto")  # 512 MiB each: the replica's process alone
    assert "shared by 4 replicas" in str(e.value) and "or use fewer --replicas" in str(e.value)


@pytest.mark.parametrize("text,value", [("1", 1), ("12", 12), ("auto", "auto"), (" AUTO ", "auto")])
def test_replicas_flag_values(text, value):
    assert parse_replicas(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5", ""])
def test_replicas_flag_refuses_other_values(text):
    with pytest.raises(ConfigError, match="--replicas must be a positive integer or auto"):
        parse_replicas(text)


@pytest.mark.parametrize("args,needle", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --ray"),
    (["--replicas", "2", "--ray-address", "x:1"], "--replicas and --ray-address need --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be a positive integer or auto, got '0'"),
    (["--ray", "--read-timeout", "5"], "--read-timeout: under --ray, Ray Serve's HTTP proxy holds the connections"),
    (["--ray", "--max-connections", "64"], "--max-connections: under --ray"),
])
def test_serve_ray_flags_are_one_line_before_anything_starts(tmp_path, capsys, args, needle):
    # the flags are checked before the model is read: an empty folder is never opened
    assert cli.main(["serve", str(tmp_path), "--port", "0", *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sluice serve: error: ") and needle in line, line


def test_serve_ray_without_ray_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert cli.main(["serve", str(tmp_path), "--port", "0", "--ray"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "sluice serve: error: --ray needs Ray Serve, which is not installed: pip install 'sluice[ray]'"
