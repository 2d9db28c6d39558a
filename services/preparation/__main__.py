"""`python -m services.preparation`: the engine fleet's control plane."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from libs.auth.policy import Authenticator
from libs.experts.store import ExpertStore
from libs.gen.expert.v1 import preparation_pb2_grpc
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging, get_logger
from services.preparation.config import PreparationConfig
from services.preparation.fleet import Fleet
from services.preparation.metrics import PreparationMetrics
from services.preparation.preparer import Preparer
from services.preparation.server import PreparationServicer
from services.preparation.staging import Stager

SERVICE = "expert.v1.PreparationService"
log = get_logger(__name__)


async def main() -> None:
    config = PreparationConfig.from_env()
    configure_logging("preparation", config.server.log_level)
    health = Health()
    fleet = Fleet(config.engine_timeout_s)
    metrics = PreparationMetrics(config.max_hot_experts)
    stager = Stager(
        ExpertStore(config.store_dir),
        metrics,
        chunk_bytes=config.stage_chunk_bytes,
        timeout_s=config.stage_timeout_s,
        max_hot=config.max_hot_experts,
        internal_token=config.auth.internal_token,
        tls=config.auth.tls,
    )
    servicer = PreparationServicer(
        fleet, Preparer(fleet, stager, metrics), metrics, config.heartbeat_interval_s
    )
    sweeper: asyncio.Task | None = None

    def register(server: grpc.aio.Server) -> list[str]:
        preparation_pb2_grpc.add_PreparationServiceServicer_to_server(servicer, server)
        return [SERVICE]

    async def sweep() -> None:
        while True:
            await asyncio.sleep(config.heartbeat_interval_s / 2)
            for engine in fleet.expire():
                metrics.expired.inc()
                log.warning("engine dropped: no heartbeat", engine=engine.engine_id, jobs=list(engine.jobs))
            metrics.update(fleet)

    async def on_start() -> None:
        nonlocal sweeper
        sweeper = asyncio.create_task(sweep())
        await health.set_serving(True)

    async def on_stop() -> None:
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
        await stager.close()

    # Every method is internal (the default): preparation has no key store to verify API keys.
    auth = Authenticator(config.auth, {})
    await serve(
        "preparation", config.server, register, health=health, on_start=on_start, on_stop=on_stop, auth=auth
    )


if __name__ == "__main__":
    run(main(), service="preparation")
