"""The engine's membership in the fleet: register with preparation, then heartbeat its load.

Preparation may be down or restart: registration is retried with backoff, and a heartbeat that
preparation does not recognise triggers a new registration. Both carry the experts the engine holds,
so preparation's view follows loads it did not make and evictions.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from libs.engine.async_engine import AsyncLLMEngine
from libs.gen.expert.v1 import common_pb2, preparation_pb2, preparation_pb2_grpc
from libs.logging import get_logger
from services.engine.server import engine_load, expert_holdings, model_spec

log = get_logger(__name__)


class Membership:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        engine_id: str,
        address: str,
        preparation: preparation_pb2_grpc.PreparationServiceStub,
        interval_s: float,
    ) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.address = address
        self.preparation = preparation
        self.interval_s = interval_s
        self.registered = asyncio.Event()
        # This process: preparation keeps our placements across a re-registration only if it is us.
        self.instance_id = uuid.uuid4().hex

    async def info(self) -> common_pb2.EngineInfo:
        return common_pb2.EngineInfo(
            engine_id=self.engine_id,
            address=self.address,
            instance_id=self.instance_id,
            model=model_spec(self.engine),
            load=engine_load(self.engine),
            experts=expert_holdings(await self.engine.expert_holdings()),
        )

    async def run(self) -> None:
        backoff = 0.1
        while True:
            try:
                if not self.registered.is_set():
                    response = await self.preparation.RegisterEngine(
                        preparation_pb2.RegisterEngineRequest(engine=await self.info()), timeout=5.0
                    )
                    self.interval_s = response.heartbeat_interval_ms / 1000 or self.interval_s
                    self.registered.set()
                    log.info("registered with preparation", engine=self.engine_id, address=self.address)
                else:
                    response = await self.preparation.Heartbeat(
                        preparation_pb2.HeartbeatRequest(
                            engine_id=self.engine_id,
                            load=engine_load(self.engine),
                            experts=expert_holdings(await self.engine.expert_holdings()),
                        ),
                        timeout=5.0,
                    )
                    if not response.known:
                        log.warning("preparation does not know this engine; registering again")
                        self.registered.clear()
                        continue
                backoff = 0.1
                await asyncio.sleep(self.interval_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("preparation unreachable", error=exc.details(), retry_in=backoff)
                self.registered.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
