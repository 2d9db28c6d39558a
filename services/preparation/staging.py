"""Staging: an expert package from the store onto an engine, only when that engine lacks that exact
version, after unloading the least recently used experts no job references if room is short.

Preparation is the only one that loads experts on engines in normal operation, so it keeps each
engine's host tier from overflowing itself: the engine would otherwise evict an expert on its own,
possibly one a placed job is about to use. Loads and unloads on one engine run one at a time, and an
expert a concurrent job staged meanwhile is found hot and not sent twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from libs.config import TlsConfig
from libs.errors import ServiceError, resource_exhausted, unavailable
from libs.experts.store import ExpertStore, StoreError
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from libs.grpc_client import Channels
from libs.logging import get_logger
from services.preparation.fleet import Engine, expert_key
from services.preparation.metrics import PreparationMetrics

log = get_logger(__name__)
FLOAT32_BYTES = 4


class ExpertUnavailable(Exception):
    """This expert cannot be staged (not in the store, or the engine refused its package); the job
    can go on without it."""


class EngineUnreachable(ServiceError):
    """The engine did not answer a call (UNAVAILABLE: its process is gone): preparation drops it
    at once, and the job is placed again later (UNAVAILABLE to the dispatcher)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


def _call_failed(error: grpc.aio.AioRpcError, message: str) -> ServiceError:
    """The error for a staging call to an engine that failed other than by refusing."""
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        return EngineUnreachable(message)
    return unavailable(message)


@dataclass
class StageReport:
    staged_bytes: int = 0
    staged: list[str] = field(default_factory=list)  # names sent to the engine for this job
    hot: list[str] = field(default_factory=list)  # names the engine held already
    unavailable: dict[str, str] = field(default_factory=dict)  # name -> why it could not be staged
    trace: list[str] = field(default_factory=list)


class Stager:
    def __init__(
        self,
        store: ExpertStore,
        metrics: PreparationMetrics,
        *,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        max_hot: int = 20,
        internal_token: str = "",
        tls: TlsConfig | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.max_hot = max_hot  # experts an engine keeps hot at most
        self._locks: dict[str, asyncio.Lock] = {}
        # LoadExpert/UnloadExpert are internal RPCs: the token, over mutual TLS when `tls` is given.
        self._channels = Channels(internal_token, tls)

    def host_estimate(self, expert: common_pb2.PlannedExpert) -> int:
        """Bytes the expert will take in an engine's host tier (its tensors as float32), from the
        store's entry; the package size when the entry is gone (staging then says why)."""
        try:
            return self.store.get(expert.name, expert.version).weight_elements * FLOAT32_BYTES
        except StoreError:
            return expert.vram_bytes

    async def stage(self, engine: Engine, experts: list[common_pb2.PlannedExpert]) -> StageReport:
        """Make `engine` hold each of `experts`. UNAVAILABLE when the engine cannot be reached,
        RESOURCE_EXHAUSTED when its memory is taken by experts running jobs use."""
        report = StageReport()
        keep = {expert_key(e.name, e.version) for e in experts}
        lock = self._locks.setdefault(engine.engine_id, asyncio.Lock())
        for expert in experts:
            if engine.holds(expert):
                report.hot.append(expert.name)
                self.metrics.expert_cache.labels("hit").inc()
                continue
            async with lock:
                if engine.holds(expert):  # a concurrent job staged it while this one waited
                    report.hot.append(expert.name)
                    self.metrics.expert_cache.labels("hit").inc()
                    continue
                self.metrics.expert_cache.labels("miss").inc()
                try:
                    await self._make_room(engine, self.host_estimate(expert), keep, report)
                    sent = await self._load(engine, expert)
                except ExpertUnavailable as exc:
                    report.unavailable[expert.name] = str(exc)
                    continue
            report.staged.append(expert.name)
            report.staged_bytes += sent
            report.trace.append(
                f"preparation: staged {expert.name}@{expert.version} on {engine.engine_id} ({sent} bytes)"
            )
        return report

    async def _load(self, engine: Engine, expert: common_pb2.PlannedExpert) -> int:
        path = self._blob(expert)
        data = await asyncio.get_running_loop().run_in_executor(None, path.read_bytes)
        started = time.perf_counter()
        stub = engine_pb2_grpc.EngineServiceStub(self._channels.replica(engine.info.address))
        try:
            response = await stub.LoadExpert(self._chunks(data), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ExpertUnavailable(
                    f"engine {engine.engine_id} refused its package: {exc.details()}"
                ) from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise resource_exhausted(f"engine {engine.engine_id}: {exc.details()}") from None
            raise _call_failed(
                exc, f"staging {expert.name} on engine {engine.engine_id} failed: {exc.details()}"
            ) from None
        if response.content_hash != expert.content_hash:
            # The store holds another package under this hash: never run the job with it.
            raise ExpertUnavailable(
                f"the engine loaded content {response.content_hash[:12]}…, "
                f"the plan names {expert.content_hash[:12]}…"
            )
        engine.apply_holdings(response.holdings)
        self.metrics.staged_bytes.inc(len(data))
        self.metrics.staging_latency.observe(time.perf_counter() - started)
        log.info(
            "expert staged",
            engine=engine.engine_id,
            expert=expert.name,
            version=expert.version,
            bytes=len(data),
        )
        return len(data)

    def _blob(self, expert: common_pb2.PlannedExpert) -> Path:
        try:
            path = self.store.blob_path(expert.content_hash)
        except StoreError as exc:
            raise ExpertUnavailable(str(exc)) from None
        if not path.is_file():
            raise ExpertUnavailable(
                f"its package ({expert.content_hash[:12]}…) is not in the expert store at {self.store.root}"
            )
        return path

    async def _chunks(self, data: bytes) -> AsyncIterator[engine_pb2.LoadExpertRequest]:
        yield engine_pb2.LoadExpertRequest(size=len(data))
        for offset in range(0, len(data), self.chunk_bytes):
            yield engine_pb2.LoadExpertRequest(chunk=data[offset : offset + self.chunk_bytes])

    async def _make_room(self, engine: Engine, need: int, keep: set[str], report: StageReport) -> None:
        """Unload unreferenced experts, least recently used first, until `need` more host bytes and
        one more expert fit the engine (within max_hot)."""
        held = engine.held()
        budget = engine.holdings.host_budget_bytes
        used = sum(h.host_bytes for h in held.values())
        referenced = {key.rpartition("@")[0] for key in engine.references()} | {
            k.rpartition("@")[0] for k in keep
        }
        idle = sorted(
            (k for k, h in held.items() if h.name not in referenced and h.active_requests == 0),
            key=lambda k: engine.last_used.get(k, 0.0),
        )
        count = len(held)
        for key in idle:
            if count < self.max_hot and (budget <= 0 or used + need <= budget):
                break
            if await self._unload(engine, held[key].name):
                used -= held[key].host_bytes
                count -= 1
                engine.last_used.pop(key, None)
                self.metrics.evictions.inc()
                report.trace.append(
                    f"preparation: unloaded {key} from {engine.engine_id} (least recently used)"
                )
        if budget > 0 and used + need > budget:
            raise resource_exhausted(
                f"engine {engine.engine_id}'s expert memory ({budget} bytes) is taken by experts "
                "that placed jobs use"
            )

    async def _unload(self, engine: Engine, name: str) -> bool:
        stub = engine_pb2_grpc.EngineServiceStub(self._channels.replica(engine.info.address))
        try:
            response = await stub.UnloadExpert(
                engine_pb2.UnloadExpertRequest(name=name), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return exc.code() == grpc.StatusCode.NOT_FOUND  # gone already, or in use by someone
            raise _call_failed(
                exc, f"unloading {name} on engine {engine.engine_id} failed: {exc.details()}"
            ) from None
        engine.apply_holdings(response.holdings)
        return True

    async def close(self) -> None:
        await self._channels.close()
