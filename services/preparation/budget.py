"""The budget check (docs/design.md#budget-check) for a fleet whose engines pre-allocate the base
model and the KV pool, and its degradation rule ("VRAM overflow -> reduce expert count").

On an engine, the base model's weights and the KV block pool are allocated once at start, so what a
job adds is its KV blocks (checked against the free blocks the engine reports, see `fleet`) and its
experts' device footprint, which must fit the engine's expert budget (`EXPERT_ADAPTER_DEVICE_BYTES`).
Experts that do not fit together are dropped lowest score first until the rest fit; forced experts
go last, and a plan whose forced experts alone do not fit is refused rather than silently changed.
Experts that fit alone but not next to the ones running jobs pin wait in the engine's scheduler
(the other remedy, "queue the job").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from libs.errors import failed_precondition
from libs.gen.expert.v1 import common_pb2

MIB = 1 << 20


@dataclass(frozen=True)
class Dropped:
    expert: common_pb2.PlannedExpert
    reason: str
    kind: str = "budget"  # or "unavailable": not in the store, or the engine refused its package

    def line(self) -> str:
        return f"preparation: dropped {self.expert.name} (score {self.expert.score:.3f}): {self.reason}"


def fits(need_bytes: int, budget_bytes: int) -> bool:
    """Whether `need_bytes` of experts fit an expert budget (0: the engine reported none)."""
    return budget_bytes <= 0 or need_bytes <= budget_bytes


def fit_to_budget(
    experts: list[common_pb2.PlannedExpert], sizes: Mapping[str, int], budget_bytes: int, where: str
) -> tuple[list[common_pb2.PlannedExpert], list[Dropped]]:
    """The experts that fit `budget_bytes` together (in their composition order) and the dropped
    ones. `sizes` maps a name to its device bytes."""
    total = sum(sizes[e.name] for e in experts)
    kept, dropped = list(experts), []
    for expert in sorted(experts, key=lambda e: (e.forced, e.score, e.name)):
        if fits(total, budget_bytes):
            break
        if expert.forced:
            forced = [e for e in kept if e.forced]
            need = sum(sizes[e.name] for e in forced)
            raise failed_precondition(
                f"the forced experts {', '.join(e.name for e in forced)} need {need / MIB:.2f} MiB on the "
                f"device; {where} holds {budget_bytes / MIB:.2f} MiB of experts"
            )
        kept.remove(expert)
        dropped.append(
            Dropped(
                expert,
                f"the plan's experts need {total / MIB:.2f} MiB on the device, more than the "
                f"{budget_bytes / MIB:.2f} MiB {where} holds",
            )
        )
        total -= sizes[expert.name]
    return kept, dropped
