"""Seed 000's budget check and the placement of a job: the least-loaded engine that has room.

The KV budget comes from the engine's real model shapes (layers x KV heads x head dim x dtype bytes
per token, in the engine's block size), checked against the free blocks it reports.
"""

from __future__ import annotations

import time

from libs.errors import failed_precondition, resource_exhausted, unavailable
from libs.gen.expert.v1 import common_pb2
from services.preparation.fleet import Fleet, kv_blocks_needed, kv_bytes


def place(
    fleet: Fleet, job_id: str, plan: common_pb2.ExpertPlan, exclude: set[str] = frozenset()
) -> common_pb2.Placement:
    """Reserve a slot and KV blocks for the job on the least-loaded engine that can take it now.

    UNAVAILABLE when no engine is registered, FAILED_PRECONDITION when the job needs more KV than any
    engine holds (it can never run), RESOURCE_EXHAUSTED when engines could run it but none has room
    now (the dispatcher tries again later).
    """
    started = time.perf_counter()
    engines = [e for e in fleet.engines.values() if e.engine_id not in exclude]
    if not engines:
        raise unavailable("no engine is registered" + (" (besides the ones that failed)" if exclude else ""))
    needs = {e.engine_id: kv_blocks_needed(plan, e.info.model) for e in engines}
    able = [e for e in engines if needs[e.engine_id] <= e.info.load.kv_blocks_total]
    if not able:
        largest = max(e.info.load.kv_blocks_total for e in engines)
        raise failed_precondition(
            f"the job needs {min(needs.values())} KV blocks (prompt + max_tokens); the largest engine holds "
            f"{largest}: lower max_tokens or shorten the prompt"
        )
    ready = [e for e in able if e.free_slots > 0 and e.available_blocks() >= needs[e.engine_id]]
    if not ready:
        raise resource_exhausted("every engine is busy; the job will be placed when one has room")
    engine = min(ready, key=lambda e: (len(e.jobs) / max(e.info.load.max_num_seqs, 1), -e.available_blocks()))
    blocks = needs[engine.engine_id]
    fleet.place(job_id, engine, blocks)
    return common_pb2.Placement(
        engine_id=engine.engine_id,
        address=engine.info.address,
        experts=plan.experts,
        kv_blocks_needed=blocks,
        kv_bytes_needed=kv_bytes(blocks, engine.info.model),
        preparation_latency_ms=(time.perf_counter() - started) * 1000,
    )
