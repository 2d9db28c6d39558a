"""PreparationService: the engine registry, placement with staging, and capacity."""

from __future__ import annotations

import time

import grpc

from libs.errors import invalid_argument, invalid_arguments
from libs.gen.expert.v1 import common_pb2, preparation_pb2, preparation_pb2_grpc
from libs.logging import bind_context, get_logger
from libs.timestamps import timestamp
from services.preparation.fleet import Engine, Fleet
from services.preparation.metrics import PreparationMetrics
from services.preparation.preparer import Preparer

log = get_logger(__name__)


class PreparationServicer(preparation_pb2_grpc.PreparationServiceServicer):
    def __init__(
        self, fleet: Fleet, preparer: Preparer, metrics: PreparationMetrics, heartbeat_interval_s: float
    ) -> None:
        self.fleet = fleet
        self.preparer = preparer
        self.metrics = metrics
        self.heartbeat_interval_s = heartbeat_interval_s

    async def RegisterEngine(
        self, request: preparation_pb2.RegisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> preparation_pb2.RegisterEngineResponse:
        info = request.engine
        if not info.engine_id:
            raise invalid_argument("engine.engine_id", "must not be empty")
        if not info.address:
            raise invalid_argument("engine.address", "must not be empty")
        if info.model.block_size < 1 or info.model.num_layers < 1:
            raise invalid_argument("engine.model", "block_size and num_layers must be set")
        kept = len(self.fleet.register(info).jobs)
        self.metrics.update(self.fleet)
        log.info(
            "engine registered",
            engine=info.engine_id,
            address=info.address,
            model=info.model.name,
            placements_kept=kept,
        )
        return preparation_pb2.RegisterEngineResponse(
            heartbeat_interval_ms=int(self.heartbeat_interval_s * 1000)
        )

    async def Heartbeat(
        self, request: preparation_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> preparation_pb2.HeartbeatResponse:
        known = self.fleet.heartbeat(
            request.engine_id, request.load, request.experts if request.HasField("experts") else None
        )
        self.metrics.update(self.fleet)
        return preparation_pb2.HeartbeatResponse(known=known)

    async def Prepare(
        self, request: preparation_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> preparation_pb2.PrepareResponse:
        with bind_context(job_id=request.job_id):
            started = time.perf_counter()
            try:
                placement = await self.preparer.prepare(
                    request.job_id,
                    request.plan,
                    set(request.exclude_engines),
                    request.model,
                    session=request.session,
                    session_engine=request.session_engine,
                    lost=request.lost_engines,
                )
            except Exception as exc:
                self.metrics.refused.labels(getattr(getattr(exc, "code", None), "name", "INTERNAL")).inc()
                raise
            self.metrics.prepare_latency.observe(time.perf_counter() - started)
            self.metrics.placed.labels(placement.engine_id).inc()
            self.metrics.update(self.fleet)
            log.debug("job placed", engine=placement.engine_id, experts=[e.name for e in placement.experts])
            return preparation_pb2.PrepareResponse(placement=placement)

    async def Release(
        self, request: preparation_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> preparation_pb2.ReleaseResponse:
        if not request.job_ids:
            raise invalid_argument("job_ids", "name at least one job")
        blank = [i for i, job_id in enumerate(request.job_ids) if not job_id]
        if blank:
            raise invalid_arguments([(f"job_ids[{i}]", "must not be empty") for i in blank])
        released = 0
        for job_id in request.job_ids:
            held = self.fleet.release(job_id)
            released += held
            log.debug("job released", job_id=job_id, held=held)
        self.metrics.update(self.fleet)
        return preparation_pb2.ReleaseResponse(released=released)

    async def GetCapacity(
        self, request: preparation_pb2.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> preparation_pb2.GetCapacityResponse:
        capacity = self.fleet.capacity()
        return preparation_pb2.GetCapacityResponse(
            accepting=capacity.free_slots > 0,
            engines=len(self.fleet.engines),
            free_slots=capacity.free_slots,
            kv_blocks_free=capacity.kv_blocks_free,
            models=self.fleet.models(),
        )

    async def ListEngines(
        self, request: preparation_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> preparation_pb2.ListEnginesResponse:
        return preparation_pb2.ListEnginesResponse(
            engines=[self._info(e) for e in self.fleet.engines.values()]
        )

    def _info(self, engine: Engine) -> common_pb2.EngineInfo:
        info = common_pb2.EngineInfo()
        info.CopyFrom(engine.info)
        info.active_jobs = len(engine.jobs)
        # monotonic clock -> wall clock for the two timestamps
        offset = time.time() - self.fleet.clock()
        info.registered_at.CopyFrom(timestamp(engine.registered_at + offset))
        info.last_heartbeat.CopyFrom(timestamp(engine.last_heartbeat + offset))
        return info
