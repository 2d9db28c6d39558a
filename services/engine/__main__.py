"""`python -m services.engine`: the engine service (the model runner behind gRPC)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from libs.auth.policy import Authenticator
from libs.engine.adapters.registry import (
    ExpertCapacityError,
    ExpertInUseError,
    ExpertNotFoundError,
    ExpertRefusedError,
)
from libs.engine.async_engine import AsyncLLMEngine, EngineDeadError
from libs.engine.errors import InvalidRequestError
from libs.engine.sampling_params import SamplingParams
from libs.engine.sessions import SessionBusyError, SessionFullError, SessionLimitError
from libs.engine.tokenizer import ChatTemplateError, UnencodableTextError
from libs.errors import (
    ServiceError,
    failed_precondition,
    invalid_argument,
    not_found,
    resource_exhausted,
    unavailable,
)
from libs.gen.expert.v1 import engine_pb2_grpc, preparation_pb2_grpc
from libs.grpc_client import open_channel
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging, get_logger
from services.engine.config import EngineServiceConfig
from services.engine.metrics import EngineMetrics
from services.engine.registration import Membership
from services.engine.server import EngineServicer

SERVICE = "expert.v1.EngineService"
log = get_logger(__name__)


def map_error(error: BaseException) -> ServiceError | None:
    """The engine's own exceptions as gRPC statuses."""
    if isinstance(error, InvalidRequestError | ChatTemplateError | UnencodableTextError):
        return _request_error(error)
    if isinstance(error, ExpertNotFoundError):
        return not_found(str(error))
    if isinstance(error, ExpertRefusedError):
        return invalid_argument("package", str(error))
    if isinstance(error, ExpertInUseError):
        return failed_precondition(str(error))
    if isinstance(error, ExpertCapacityError):
        return resource_exhausted(str(error))
    if isinstance(error, EngineDeadError):
        return unavailable(str(error))
    if isinstance(error, SessionLimitError):
        return resource_exhausted(str(error))
    if isinstance(error, SessionBusyError | SessionFullError):
        return failed_precondition(str(error))
    return None


def _request_error(error: InvalidRequestError | ChatTemplateError | UnencodableTextError) -> ServiceError:
    """A request the engine cannot take, named by field: a bad value, a conversation the template
    refuses, or text no tokenizer takes, wherever a call renders or tokenizes it. The caller's
    error (INVALID_ARGUMENT), never the engine's (INTERNAL, which a dispatcher would take for an
    engine in trouble)."""
    if isinstance(error, UnencodableTextError):
        return invalid_argument("input", str(error))
    return invalid_argument(error.field, error.description)


async def main() -> None:
    config = EngineServiceConfig.from_env()
    configure_logging("engine", config.server.log_level)
    health = Health()
    metrics = EngineMetrics()
    servicer = EngineServicer(None, metrics, config.max_expert_bytes)  # the engine arrives in on_start
    channel = open_channel(
        config.preparation_target, internal_token=config.auth.internal_token, tls=config.auth.tls
    )
    tasks: list[asyncio.Task] = []

    def register(server: grpc.aio.Server) -> list[str]:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
        return [SERVICE]

    async def on_start() -> None:
        # The model loads (seconds) on the engine's own thread, which keeps all of torch's work there.
        engine = AsyncLLMEngine.from_config(config.engine, max_pending=config.stream_buffer)
        await engine.start()
        servicer.engine = engine
        await _warm_up(engine)
        membership = Membership(
            engine,
            config.engine_id,
            config.advertise_address,
            preparation_pb2_grpc.PreparationServiceStub(channel),
            config.heartbeat_interval_s,
        )
        tasks.append(asyncio.create_task(membership.run()))
        tasks.append(asyncio.create_task(_publish_stats(engine, metrics)))
        log.info(
            "engine ready",
            engine=config.engine_id,
            kernels=engine.model_info.kernels,
            weights=engine.model_info.weight_formats,
            model=config.engine.model,
        )
        await health.set_serving(True)

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if servicer.engine is not None:
            await servicer.engine.shutdown()
        await channel.close()

    await serve(
        "engine",
        config.server,
        register,
        health=health,
        on_start=on_start,
        on_stop=on_stop,
        error_mapper=map_error,
        # Every method is internal (the default), LoadExpert/UnloadExpert included: the engine has
        # no key store, and preparation calls them with the internal token.
        auth=Authenticator(config.auth, {}),
    )


async def _warm_up(engine: AsyncLLMEngine) -> None:
    """One real generation through the whole path before declaring SERVING."""
    async for _ in engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)):
        pass


async def _publish_stats(engine: AsyncLLMEngine, metrics: EngineMetrics) -> None:
    while True:
        metrics.update(engine.get_stats())
        await asyncio.sleep(1.0)


if __name__ == "__main__":
    run(main(), service="engine")
