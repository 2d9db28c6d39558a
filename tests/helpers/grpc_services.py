"""A real `serve()` for the gRPC tests, with small servicers of the generated RouterService,
EngineService and InferenceService stubs that do what the request says: echo, raise a ServiceError,
raise a bug, abort, sleep until cancelled, fail with UNAVAILABLE a few times, report the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs import errors
from libs.config import ServerConfig
from libs.gen.expert.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from libs.grpc_client import call, open_channel
from libs.grpc_server import Health, serve
from libs.logging import get_logger
from tests.helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SERVICE = "grpctest"
ROUTER = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
ENGINE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
PLAN_METHOD = f"{ROUTER}/Plan"

_log = get_logger(__name__)


def remaining_timeout(context: grpc.aio.ServicerContext | None, default: float | None) -> float | None:
    """The timeout for a call made while serving `context`: the time left on the incoming call, so
    the whole chain gives up together, or `default` when the incoming call has no deadline (or
    there is none). Never negative."""
    remaining = context.time_remaining() if context is not None else None
    if remaining is None:
        return default
    return max(0.0, remaining)


class DomainLookupError(Exception):
    """Stands for a domain exception that a service's error_mapper translates."""


def map_domain_errors(error: BaseException) -> errors.ServiceError | None:
    if isinstance(error, DomainLookupError):
        return errors.not_found(str(error))
    return None


def plan_request(job_id: str, prompt: str = "", user_id: str = "") -> router_pb2.PlanRequest:
    return router_pb2.PlanRequest(
        job_id=job_id, request=common_pb2.InferenceRequest(prompt=prompt, user_id=user_id)
    )


class Router(router_pb2_grpc.RouterServiceServicer):
    """Plan does what the job id says; otherwise it echoes the prompt."""

    def __init__(self) -> None:
        self.peer = ""
        self.calls: dict[str, int] = {}
        self.slow_started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def Plan(self, request, context):
        action, prompt = request.job_id, request.request.prompt
        if action == "invalid":
            raise errors.invalid_argument("request.temperature", "must be in [0, 2], got 3")
        if action == "bug":
            raise RuntimeError("database password is hunter2")
        if action == "domain":
            raise DomainLookupError(f"expert {prompt!r} is not registered")
        if action == "abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
        if action == "log":
            _log.info("planning")
        if action == "slow":
            self.slow_started.set()
            try:
                await asyncio.sleep(float(prompt))
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if action == "flaky":
            # Fails with UNAVAILABLE as many times as the prompt says, counted per user_id.
            key = request.request.user_id
            self.calls[key] = self.calls.get(key, 0) + 1
            if self.calls[key] <= int(prompt):
                raise errors.unavailable("warming up")
        if action == "remaining":
            return router_pb2.PlanResponse(
                plan=common_pb2.ExpertPlan(router_latency_ms=remaining_timeout(context, 99.0))
            )
        if action == "forward":
            async with open_channel(self.peer) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                timeout = remaining_timeout(context, 30.0)
                return await call(stub.Plan, plan_request("remaining"), timeout=timeout, idempotent=True)
        return router_pb2.PlanResponse(plan=common_pb2.ExpertPlan(prompt_modified=prompt))


class Engine(engine_pb2_grpc.EngineServiceServicer):
    """Generate (an async generator) yields the words of the request id, fails on "fail" and waits
    to be cancelled on "wait"; LoadExpert (stream-unary) sums chunk sizes. GetStats is left
    UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.closed = asyncio.Event()

    async def Generate(self, request, context):
        try:
            for word in request.request_id.split():
                if word == "fail":
                    raise errors.resource_exhausted("KV cache full")
                if word == "wait":
                    self.waiting.set()
                    await asyncio.sleep(30)
                yield engine_pb2.GenerateResponse(text=word)
        finally:
            self.closed.set()

    async def LoadExpert(self, request_iterator, context):
        size = 0
        async for part in request_iterator:
            size += len(part.chunk)
        if size == 0:
            raise errors.invalid_argument("chunk", "the package is empty")
        return engine_pb2.LoadExpertResponse(name=str(size))


class Inference(inference_pb2_grpc.InferenceServiceServicer):
    """InferStream writes with context.write() (the coroutine style) and fails on "fail"."""

    async def InferStream(self, request, context):
        for word in request.request.prompt.split():
            if word == "fail":
                raise RuntimeError("stream broke")
            await context.write(inference_pb2.InferStreamResponse(delta=common_pb2.ChoiceDelta(text=word)))


@dataclass
class Running:
    target: str
    channel: grpc.aio.Channel
    health: Health
    router: Router
    engine: Engine

    @property
    def router_stub(self) -> router_pb2_grpc.RouterServiceStub:
        return router_pb2_grpc.RouterServiceStub(self.channel)


@contextlib.asynccontextmanager
async def running(*, metrics_port: int = 0, auth=None):
    """A real serve() with the three servicers, stopped through its `stop` event at the end;
    `auth` (a libs.auth.policy.Authenticator) checks the calls' credentials."""
    router, engine, health, stop = Router(), Engine(), Health(), asyncio.Event()
    config = ServerConfig(
        bind_host="127.0.0.1", port=free_port(), metrics_port=metrics_port, log_level="info"
    )

    def register(server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(router, server)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(Inference(), server)
        return [ROUTER, ENGINE, INFERENCE]

    serving = asyncio.create_task(
        serve(
            SERVICE,
            config,
            register,
            health=health,
            error_mapper=map_domain_errors,
            auth=auth,
            grace=2.0,
            stop=stop,
        )
    )
    target = f"127.0.0.1:{config.port}"
    router.peer = target
    channel = open_channel(target, tls=auth.config.tls if auth is not None else None)
    try:
        ready = asyncio.ensure_future(channel.channel_ready())
        await asyncio.wait({ready, serving}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()
        if not ready.done():
            ready.cancel()
            raise AssertionError("the server did not start listening within 10 s")
        yield Running(target, channel, health, router, engine)
    finally:
        await channel.close()
        stop.set()
        await asyncio.wait_for(serving, 10)


async def health_status(channel: grpc.aio.Channel, service: str) -> str:
    """The grpc.health.v1 status of `service` ("" for the server), e.g. "SERVING"."""
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def rpc_count(code: str, method: str = PLAN_METHOD) -> float:
    """How many RPCs of `method` the test servers answered with `code`, from the default registry."""
    value = prometheus_client.REGISTRY.get_sample_value(
        f"expert_{SERVICE}_rpc_requests_total", {"method": method, "code": code}
    )
    return value or 0.0


def json_lines(text: str) -> list[dict]:
    """The JSON log lines in captured output (gRPC's own C-core lines on stderr are not JSON)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
