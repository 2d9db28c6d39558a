"""The other stages as the pipeline sees them: one small protocol, so the saga in `pipeline.py` can be
run against the real services (`GrpcStages`) or against stages in memory (the unit tests).

A stage that fails raises `grpc.aio.AioRpcError`, as a gRPC call does: the pipeline decides by the
status code (a request error, a stage down, no room yet), whichever implementation answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from libs.batching import Coalescer
from libs.gen.expert.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    postproc_pb2,
    preparation_pb2,
    router_pb2,
)
from libs.grpc_client import call
from libs.logging import get_logger
from services.reception.peers import Peers

log = get_logger(__name__)
# How long a release (a job's engine slot at preparation, a session's KV at its engine) may take.
# Each has a fallback (preparation forgets the jobs of an engine that stops heartbeating, an engine
# ends a session left idle), but a job's slot on a live engine stays reserved until released, so
# its call gets room for `call`'s retries. A reachable peer answers in milliseconds and a stopped
# one refuses at once: only a hung peer makes a caller wait this long.
RELEASE_TIMEOUT_S = 5.0
PEER_WAIT_S = 10.0  # how long a router that answers UNAVAILABLE is waited for by a job with no deadline


class GenerateStream(Protocol):
    """An engine's answer to Generate: its messages as they come, and a way to stop reading (which
    aborts the engine request)."""

    def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]: ...

    def cancel(self) -> bool: ...


class Stages(Protocol):
    async def plan(self, request: router_pb2.PlanRequest, timeout: float | None) -> common_pb2.ExpertPlan: ...

    async def prepare(
        self, request: preparation_pb2.PrepareRequest, timeout: float | None
    ) -> common_pb2.Placement: ...

    async def release(self, job_id: str) -> None:
        """Give the job's engine slot back. Never raises: preparation also forgets a job whose
        engine is gone."""

    async def generate(
        self, address: str, request: engine_pb2.GenerateRequest, timeout: float | None
    ) -> GenerateStream: ...

    async def abort(self, address: str, request_id: str, timeout: float) -> None: ...

    async def release_session(self, address: str, session_id: str) -> None:
        """Have the engine at `address` forget a session and free the KV it keeps (within
        RELEASE_TIMEOUT_S)."""

    async def finalize(
        self, request: postproc_pb2.FinalizeRequest, timeout: float
    ) -> common_pb2.InferenceResult:
        """Postproc's result for the job; a postproc that answers UNAVAILABLE (down, restarting) is
        called again until `timeout` has passed."""


class GrpcStages:
    """The stages over gRPC. Releases of jobs that end together (a batch finishing in one engine
    step) go to preparation in one call."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self._releases = Coalescer(self._release_all)

    async def plan(self, request: router_pb2.PlanRequest, timeout: float | None) -> common_pb2.ExpertPlan:
        # A router being restarted or rolled out is waited for, up to the job's deadline, as an
        # engine is: the job should not fail for a gap its replacement closes, however long the
        # router takes to load.
        patience = PEER_WAIT_S if timeout is None else timeout
        response = await call(
            self.peers.router.Plan, request, timeout=timeout, idempotent=True, patience_s=patience
        )
        return response.plan

    async def prepare(
        self, request: preparation_pb2.PrepareRequest, timeout: float | None
    ) -> common_pb2.Placement:
        # Not retried by `call`: a Prepare that reached preparation has reserved a slot.
        response = await call(self.peers.preparation.Prepare, request, timeout=timeout, idempotent=False)
        return response.placement

    async def release(self, job_id: str) -> None:
        await self._releases.submit(job_id)

    async def _release_all(self, job_ids: list[str]) -> None:
        try:
            await call(
                self.peers.preparation.Release,
                preparation_pb2.ReleaseRequest(job_ids=job_ids),
                timeout=RELEASE_TIMEOUT_S,
                idempotent=True,
            )
        except grpc.aio.AioRpcError as exc:  # preparation forgets the jobs with their engine anyway
            log.warning("release failed", job_ids=job_ids, error=exc.details())

    async def generate(
        self, address: str, request: engine_pb2.GenerateRequest, timeout: float | None
    ) -> GenerateStream:
        stub = engine_pb2_grpc.EngineServiceStub(self.peers.engine_channel(address))
        return stub.Generate(request, timeout=timeout)

    async def abort(self, address: str, request_id: str, timeout: float) -> None:
        stub = engine_pb2_grpc.EngineServiceStub(self.peers.engine_channel(address))
        await stub.Abort(engine_pb2.AbortRequest(request_id=request_id), timeout=timeout)

    async def release_session(self, address: str, session_id: str) -> None:
        stub = engine_pb2_grpc.EngineServiceStub(self.peers.engine_channel(address))
        await stub.ReleaseSession(
            engine_pb2.ReleaseSessionRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S
        )

    async def finalize(
        self, request: postproc_pb2.FinalizeRequest, timeout: float
    ) -> common_pb2.InferenceResult:
        response = await call(
            self.peers.postproc.Finalize, request, timeout=timeout, idempotent=True, patience_s=timeout
        )
        return response.result
