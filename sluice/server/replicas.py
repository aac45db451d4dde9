"""How many replicas of a model a Ray cluster holds, and what each takes: `size_replicas(need, nodes, ...)` -> Sizing.

Pure arithmetic over the load plan's figures and the nodes' CPUs and memory, so it is tested without Ray
(serve_ray.py reads the nodes from the cluster and hands the result to Ray Serve as each replica's resources).

A replica is one process holding one model: `threads` compute threads (its Ray CPUs) and `need` bytes -- what the
load plan counts (the weights its budget keeps: everything with `--memory all`, the resident weights and the expert
slots the budget buys when streaming; its KV cache; the runtime reserve; n-gram tables it holds) and REPLICA_PROCESS
for the Ray worker process around it. Ray's own processes on a node (GCS, raylet, agents, the Serve controller and
proxy, the ingress, the `sluice serve` driver) take RAY_PROCESSES of a node's memory first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import BudgetError, ConfigError
from ..store.budget import RUNTIME_RESERVE, auto_memory, kept_bytes
from ..units import format_bytes

# Memory of Ray's own processes on a node, before any replica: measured 1,554-1,556 MiB of RSS on the local cluster of
# benchmarks/results/ray (every process below `sluice serve --ray` less its replicas: gcs_server, raylet, dashboard
# and runtime-env agents, log monitor, autoscaler monitor, ServeController, ProxyActor, the ingress, and the driver
# itself, 353 MiB); shared pages counted in every process, so an upper bound. A node that joins holds fewer of them.
RAY_PROCESSES = 1536 * 2**20
# A replica's process beyond what the load plan counts: the Ray worker's own libraries and the load's transient
# copies. Measured peak RSS (VmHWM) 101-428 MiB above the plan's figure (benchmarks/results/ray: 1,587 and 1,759 MiB
# for 1,331 MiB resident, 880 MiB for 779 MiB streamed; a plain `sluice serve` of the same resident model 1,680 MiB).
REPLICA_PROCESS = 512 * 2**20


@dataclass(frozen=True)
class Node:
    """What one Ray node offers replicas: its CPUs and the memory Ray schedules there (its "memory" resource)."""

    cpus: int
    memory: int

    def room(self) -> int:
        """The memory left for replicas once Ray's own processes are counted."""
        return max(0, self.memory - RAY_PROCESSES)


@dataclass(frozen=True)
class ModelNeed:
    """The load plan's figures a replica's memory is made of (plan.py LoadPlan)."""

    resident_bytes: int  # weights always held (attention, norms, router, embeddings, shared experts)
    expert_bytes: int  # one expert of one layer
    total_experts: int  # experts over all MoE layers
    top_k: int
    kv_bytes: int  # the KV cache (and recurrent state) of one replica
    tables_bytes: int = 0  # n-gram tables the replica holds (qwen4_exp with --ple resident)

    @classmethod
    def of_plan(cls, p) -> "ModelNeed":
        return cls(p.resident_bytes, p.layout.expert_nbytes, p.layout.total_experts, p.spec.top_k, p.kv_bytes,
                   p.ple_bytes if p.ple == "resident" else 0)

    def bytes_at(self, memory: int | None) -> int:
        """What one replica takes with budget `memory` (None: every weight resident): the plan's figure and the
        process around it."""
        kept = kept_bytes(memory, self.resident_bytes, self.expert_bytes, self.total_experts)
        return kept + self.kv_bytes + RUNTIME_RESERVE + self.tables_bytes + REPLICA_PROCESS


@dataclass(frozen=True)
class Sizing:
    """The replicas to deploy: how many, the threads (Ray CPUs) and the budget each loads with, what each takes."""

    replicas: int
    threads: int
    memory: int | None  # each replica's --memory (None: everything resident)
    need: int  # bytes one replica takes (ModelNeed.bytes_at(memory)): its Ray memory resource
    why: str  # how the count was chosen, for the start-up line

    def describe(self) -> str:
        budget = "everything resident" if self.memory is None else f"budget {format_bytes(self.memory)}"
        return (f"{self.replicas} replica{'s' * (self.replicas != 1)} ({self.why}), each {self.threads} "
                f"thread{'s' * (self.threads != 1)} and {format_bytes(self.need)} ({budget})")


def parse_replicas(value: str) -> int | str:
    """--replicas: a positive integer or "auto"; ConfigError naming the flag otherwise."""
    text = value.strip().lower()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ConfigError(f"--replicas must be a positive integer or auto, got {value!r}")


def capacity(nodes: list[Node], threads: int, need: int) -> int:
    """Replicas of `threads` CPUs and `need` bytes the nodes hold, each node filled on its own."""
    return sum(min(n.cpus // threads, n.room() // need) for n in nodes) if need > 0 else 0


def _describe(nodes: list[Node]) -> str:
    shown = ", ".join(f"{n.cpus} CPUs / {format_bytes(n.memory)}" for n in nodes[:4])
    more = f" and {len(nodes) - 4} more" if len(nodes) > 4 else ""
    return f"{len(nodes)} node{'s' * (len(nodes) != 1)} ({shown}{more}; {format_bytes(RAY_PROCESSES)} of each for Ray)"


def size_replicas(need: ModelNeed, nodes: list[Node], replicas: int | str, threads: int,
                  memory: int | str | None) -> Sizing:
    """The replicas to deploy on `nodes`.

    `replicas`: a count, or "auto": as many as the nodes hold. `threads`: per replica (0: the cluster's CPUs shared
    out among a given count, 1 each for auto). `memory`: the load option -- a budget (bytes) or None (everything
    resident) is each replica's; "auto" is resident when the model fits in a replica's share of a node (auto: the
    smallest node's room), else streamed with that share as the budget (auto: one replica a node).
    A count the nodes cannot hold is a ConfigError saying how many fit (Ray would otherwise leave the rest pending
    for ever); a share too small for one replica is a BudgetError naming the smallest room that works.
    """
    nodes = [n for n in nodes if n.cpus > 0]
    if not nodes:
        raise ConfigError("the Ray cluster has no node with CPUs for a replica: start one (`ray start "
                          "--address HEAD --num-cpus N`)")
    smallest = min(n.room() for n in nodes)
    if threads == 0:
        threads = 1 if replicas == "auto" else max(1, min(max(n.cpus for n in nodes),
                                                          sum(n.cpus for n in nodes) // replicas))
    if memory == "auto":
        per_node = 1 if replicas == "auto" else math.ceil(replicas / len(nodes))
        share = smallest // per_node
        if replicas == "auto" and need.bytes_at(None) <= share:
            memory = None
        else:
            source = (f"the smallest node's {format_bytes(smallest)} left beside Ray's processes"
                      + (f", shared by {per_node} replicas" if per_node > 1 else "")
                      + f", less {format_bytes(REPLICA_PROCESS)} for a replica's process")
            try:  # the plan's room: the share less the replica's process
                memory = auto_memory(max(0, share - REPLICA_PROCESS), source, need.resident_bytes, need.expert_bytes,
                                     need.total_experts, need.top_k, need.kv_bytes).memory
            except BudgetError as e:
                raise BudgetError(f"{e}{'; or use fewer --replicas' if per_node > 1 else ''}") from None
    each = need.bytes_at(memory)
    fits = capacity(nodes, threads, each)
    what = f"{threads} thread{'s' * (threads != 1)} and {format_bytes(each)} each"
    if fits < 1:
        raise ConfigError(f"not one replica of {what} fits in {_describe(nodes)}: lower --threads, --memory or "
                          "--max-context, or add a node")
    if replicas == "auto":
        return Sizing(fits, threads, memory, each, f"auto: as many as {_describe(nodes)} hold")
    if replicas > fits:
        raise ConfigError(f"--replicas {replicas}: replicas of {what} do not fit in {_describe(nodes)}, which "
                          f"holds {fits}; use --replicas {fits} or auto, fewer --threads, a smaller --memory or "
                          "--max-context, or add a node")
    return Sizing(replicas, threads, memory, each, "--replicas")
