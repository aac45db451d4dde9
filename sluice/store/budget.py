"""How a memory budget splits into resident weights and expert slots (DESIGN: the store owns the budget)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BudgetError
from ..options import format_bytes


@dataclass(frozen=True)
class BudgetPlan:
    """memory = resident + slots * expert_bytes (+ slack). The KV cache is accounted separately."""

    memory: int
    resident_bytes: int
    expert_bytes: int  # one expert of one layer, all projections
    slots: int
    total_experts: int  # experts over all MoE layers

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def cached_fraction(self) -> float:
        return min(1.0, self.slots / self.total_experts) if self.total_experts else 1.0


def plan_budget(memory: int, resident_bytes: int, expert_bytes: int, top_k: int, total_experts: int) -> BudgetPlan:
    """Slots = (memory - resident) // expert_bytes, capped at the number of experts.

    Raises BudgetError when fewer than `top_k` slots remain (one token of one layer could not run), stating the
    smallest budget that works.
    """
    slots = max(0, (memory - resident_bytes) // expert_bytes) if expert_bytes else 0
    if slots < top_k:
        need = resident_bytes + top_k * expert_bytes
        raise BudgetError(
            f"--memory {format_bytes(memory)} is too small: resident weights take {format_bytes(resident_bytes)} "
            f"and one layer needs {top_k} expert slots of {format_bytes(expert_bytes)}; "
            f"the smallest budget that works is {format_bytes(need)} ({need} bytes)"
        )
    return BudgetPlan(memory, resident_bytes, expert_bytes, min(slots, total_experts), total_experts)
