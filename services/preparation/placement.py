"""The engine for a job: among the engines that can take it now, the one that already holds the most
of its experts hot, then the least loaded.

An engine can take the job when it has a free sequence slot, the KV blocks for the prompt and
max_tokens (from its real model shapes: layers x KV heads x head dim x dtype bytes per token, in its
block size) and an expert budget that holds the plan's experts together.
"""

from __future__ import annotations

from collections.abc import Mapping

from libs.errors import failed_precondition, resource_exhausted, unavailable
from libs.gen.expert.v1 import common_pb2
from services.preparation.budget import fits
from services.preparation.fleet import Engine, Fleet, kv_blocks_needed


def eligible(fleet: Fleet, exclude: set[str], model: str = "") -> list[Engine]:
    """The engines that may take a job for `model` (empty: any), less `exclude`.

    UNAVAILABLE when none is registered (the job waits for one), FAILED_PRECONDITION when engines
    are registered but none serves `model` (it would wait forever: the job fails at once)."""
    engines = [e for e in fleet.engines.values() if e.engine_id not in exclude]
    if not engines:
        raise unavailable("no engine is registered" + (" (besides the ones that failed)" if exclude else ""))
    if model:
        engines = [e for e in engines if e.info.model.name == model]
        if not engines:
            served = ", ".join(m.name for m in fleet.models()) or "none"
            raise failed_precondition(f"no engine serves the model {model!r} (served: {served})")
    return engines


def for_session(engines: list[Engine], session_engine: str) -> list[Engine]:
    """The engines a session turn may go to. A session stays on its engine while that engine is
    registered (its KV is there: the turn waits for room rather than move); its first turn, or one
    whose engine is gone, goes to an engine with room for another session, or, when every engine is
    at its limit, to any (whose refusal then names the limit)."""
    pinned = [e for e in engines if e.engine_id == session_engine]
    if pinned:
        return pinned
    with_room = [e for e in engines if e.info.load.sessions < e.info.load.max_sessions]
    return with_room or engines


def choose_engine(
    engines: list[Engine],
    plan: common_pb2.ExpertPlan,
    experts: list[common_pb2.PlannedExpert],
    sizes: Mapping[str, int],
) -> tuple[Engine, int]:
    """The engine and the KV blocks the job needs there.

    FAILED_PRECONDITION when the job needs more KV than any engine holds (it can never run),
    RESOURCE_EXHAUSTED when engines could run it but none has room now (the dispatcher tries again).
    """
    needs = {e.engine_id: kv_blocks_needed(plan, e.info.model) for e in engines}
    able = [e for e in engines if needs[e.engine_id] <= e.info.load.kv_blocks_total]
    if not able:
        largest = max(e.info.load.kv_blocks_total for e in engines)
        raise failed_precondition(
            f"the job needs {min(needs.values())} KV blocks (prompt + max_tokens); the largest engine holds "
            f"{largest}: lower max_tokens or shorten the prompt"
        )
    device_need = sum(sizes[x.name] for x in experts)
    able = [e for e in able if fits(device_need, e.holdings.device_budget_bytes)]
    ready = [e for e in able if e.free_slots > 0 and e.available_blocks() >= needs[e.engine_id]]
    if not ready:
        raise resource_exhausted("every engine is busy; the job will be placed when one has room")

    def preference(engine: Engine) -> tuple:
        hot = sum(engine.holds(x) for x in experts)
        load = len(engine.jobs) / max(engine.info.load.max_num_seqs, 1)
        return (-hot, load, -engine.available_blocks())

    engine = min(ready, key=preference)
    return engine, needs[engine.engine_id]
