"""Preparation for one job, outside the accelerator: fit the plan's experts to the budget, choose
the engine, reserve its slot and KV, stage the experts it lacks, and say what happened.

The budget is checked twice. Before staging, with the best size known for each expert: the exact
device footprint an engine reported for it if one holds it, else its tensors as float32 from the
store (the score's vram_mb, docs/design.md#selection-and-score). After staging, with the exact
footprints the chosen engine reports. Each check drops the lowest-scored experts until the rest fit
(see `budget`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from libs.errors import failed_precondition
from libs.gen.expert.v1 import common_pb2
from libs.logging import get_logger
from services.preparation.budget import Dropped, fit_to_budget
from services.preparation.fleet import Engine, Fleet, expert_key, kv_bytes
from services.preparation.metrics import PreparationMetrics
from services.preparation.placement import choose_engine, eligible, for_session
from services.preparation.staging import EngineUnreachable, Stager

log = get_logger(__name__)


class Preparer:
    def __init__(self, fleet: Fleet, stager: Stager, metrics: PreparationMetrics) -> None:
        self.fleet = fleet
        self.stager = stager
        self.metrics = metrics

    async def prepare(
        self,
        job_id: str,
        plan: common_pb2.ExpertPlan,
        exclude: set[str] = frozenset(),
        model: str = "",
        session: bool = False,
        session_engine: str = "",
        lost: Iterable[common_pb2.LostEngine] = (),
    ) -> common_pb2.Placement:
        """`session`: the job is a turn of a session, pinned to `session_engine` ("" before its first
        turn). `lost`: engine processes the job's streams broke on, dropped now if still listed."""
        started = time.perf_counter()
        for gone in lost:
            if self.fleet.drop(gone.engine_id, gone.instance_id) is not None:
                log.warning("engine dropped: a job's stream to it broke", engine=gone.engine_id)
        engines = eligible(self.fleet, exclude, model)
        if session:
            engines = for_session(engines, session_engine)
        experts = list(plan.experts)
        sizes = {e.name: self._size_estimate(e, engines) for e in experts}
        largest = max(e.holdings.device_budget_bytes for e in engines)
        experts, dropped = fit_to_budget(experts, sizes, largest, "the largest engine")
        engine, blocks = choose_engine(engines, plan, experts, sizes)
        with self.fleet.reservation(job_id, engine, blocks, _keys(experts)) as reserved:
            try:
                report = await self.stager.stage(engine, experts)
            except EngineUnreachable:
                log.warning("engine dropped: it did not answer a staging call", engine=engine.engine_id)
                self.fleet.drop(engine.engine_id, engine.info.instance_id)
                raise
            for expert in experts:
                if expert.name in report.unavailable:
                    if expert.forced:
                        raise failed_precondition(
                            f"the forced expert {expert.name}@{expert.version} cannot be staged: "
                            f"{report.unavailable[expert.name]}"
                        )
                    dropped.append(Dropped(expert, report.unavailable[expert.name], "unavailable"))
            experts = [e for e in experts if e.name not in report.unavailable]
            held = engine.held()
            exact = {e.name: held[expert_key(e.name, e.version)].device_bytes for e in experts}
            experts, more = fit_to_budget(
                experts, exact, engine.holdings.device_budget_bytes, f"engine {engine.engine_id}"
            )
            dropped += more
            reserved.experts = _keys(experts)
        self._count(dropped)
        names = {e.name for e in experts}
        trace = [
            f"preparation: engine {engine.engine_id} ({len(report.hot)} of the plan's experts hot there, "
            f"{len(engine.jobs)}/{engine.info.load.max_num_seqs} slots taken)",
            *report.trace,
            *(d.line() for d in dropped),
        ]
        return common_pb2.Placement(
            engine_id=engine.engine_id,
            engine_instance_id=engine.info.instance_id,
            address=engine.info.address,
            experts=experts,
            dropped_experts=[d.expert.name for d in dropped],
            kv_blocks_needed=blocks,
            kv_bytes_needed=kv_bytes(blocks, engine.info.model),
            preparation_latency_ms=(time.perf_counter() - started) * 1000,
            staged_bytes=report.staged_bytes,
            hot_experts=[name for name in report.hot if name in names],
            staged_experts=[name for name in report.staged if name in names],
            trace=trace,
        )

    def _size_estimate(self, expert: common_pb2.PlannedExpert, engines: list[Engine]) -> int:
        for engine in engines:
            held = engine.held().get(expert_key(expert.name, expert.version))
            if held is not None and held.content_hash == expert.content_hash:
                return held.device_bytes
        return self.stager.host_estimate(expert)

    def _count(self, dropped: list[Dropped]) -> None:
        if dropped:
            self.metrics.degraded.inc()
        for d in dropped:
            self.metrics.dropped.labels(d.kind).inc()


def _keys(experts: list[common_pb2.PlannedExpert]) -> tuple[str, ...]:
    return tuple(expert_key(e.name, e.version) for e in experts)
