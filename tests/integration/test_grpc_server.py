"""libs.grpc_server against a real server: health that starts NOT_SERVING, reflection, errors mapped
to statuses with details, every streaming style intercepted, cancellation, metrics, request ids in
the logs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from libs import errors
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc
from libs.logging import configure_logging
from tests.helpers.grpc_health import wait_for_serving
from tests.helpers.grpc_services import (
    ENGINE,
    INFERENCE,
    PLAN_METHOD,
    ROUTER,
    SERVICE,
    health_status,
    json_lines,
    plan_request,
    rpc_count,
    running,
)
from tests.helpers.ports import free_port


def test_health_starts_not_serving_and_turns_serving_when_the_service_says_so():
    async def scenario():
        async with running() as server:
            assert await health_status(server.channel, "") == "NOT_SERVING"
            assert await health_status(server.channel, ROUTER) == "NOT_SERVING"
            with pytest.raises(TimeoutError, match=server.target):
                await wait_for_serving(server.target, ROUTER, timeout=0.3)
            await server.health.set_serving(True)
            await wait_for_serving(server.target, ROUTER, timeout=5)
            assert await health_status(server.channel, "") == "SERVING"
            assert await health_status(server.channel, ENGINE) == "SERVING"
            await server.health.set_serving(False)
            assert await health_status(server.channel, ROUTER) == "NOT_SERVING"
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health_status(server.channel, "expert.v1.NoSuchService")
            assert unknown.value.code() is grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_reflection_lists_the_services():
    async def scenario():
        async with running() as server:
            stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
            responses = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = {service.name async for r in responses for service in r.list_services_response.service}
            assert {ROUTER, ENGINE, INFERENCE, "grpc.health.v1.Health"} <= names

    asyncio.run(scenario())


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_reflection_v1_and_v1alpha_serve_an_outside_client(protocol):
    """buf curl (a Go client, not grpcio) lists the services and methods over each reflection
    protocol, then calls a method whose schema it downloaded that way."""
    buf = Path(sys.executable).parent / "buf"

    def curl(*args: str) -> str:
        command = [str(buf), "curl", "--protocol", "grpc", "--http2-prior-knowledge"]
        done = subprocess.run(
            [*command, "--reflect-protocol", protocol, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    async def scenario():
        async with running() as server:
            await server.health.set_serving(True)
            base = f"http://{server.target}"
            services = await asyncio.to_thread(curl, "--list-services", base)
            methods = await asyncio.to_thread(curl, "--list-methods", base)
            answer = await asyncio.to_thread(curl, "--data", "{}", f"{base}/grpc.health.v1.Health/Check")
            return set(services.split()), methods.split(), json.loads(answer)

    services, methods, answer = asyncio.run(scenario())
    assert {ROUTER, ENGINE, INFERENCE, "grpc.health.v1.Health"} <= services
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert f"{ROUTER}/Plan" in methods
    assert "grpc.reflection.v1.ServerReflection/ServerReflectionInfo" in methods
    assert answer == {"status": "SERVING"}


def test_a_service_error_becomes_its_status_with_field_violations():
    async def scenario():
        async with running() as server:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await server.router_stub.Plan(plan_request("invalid"), timeout=5)
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert errors.field_violations(raised.value) == [
                ("request.temperature", "must be in [0, 2], got 3")
            ]
            assert (
                errors.describe(raised.value)
                == "INVALID_ARGUMENT: request.temperature: must be in [0, 2], got 3"
            )

    asyncio.run(scenario())


def test_an_unexpected_exception_becomes_internal_with_a_generic_message(capsys):
    configure_logging(SERVICE)

    async def scenario():
        async with running() as server:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await server.router_stub.Plan(plan_request("bug"), timeout=5)
            assert raised.value.code() is grpc.StatusCode.INTERNAL
            assert raised.value.details() == "internal error"

    asyncio.run(scenario())
    (logged,) = [line for line in json_lines(capsys.readouterr().out) if line["event"] == "unexpected error"]
    assert logged["method"] == f"/{PLAN_METHOD}"
    assert "RuntimeError: database password is hunter2" in logged["exception"]


def test_the_error_mapper_translates_domain_exceptions():
    async def scenario():
        async with running() as server:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await server.router_stub.Plan(plan_request("domain", "sql"), timeout=5)
            assert raised.value.code() is grpc.StatusCode.NOT_FOUND
            assert raised.value.details() == "expert 'sql' is not registered"

    asyncio.run(scenario())


def test_an_abort_by_the_servicer_passes_through_unchanged():
    async def scenario():
        async with running() as server:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await server.router_stub.Plan(plan_request("abort"), timeout=5)
            assert (raised.value.code(), raised.value.details()) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "not yours",
            )

    asyncio.run(scenario())


def test_streaming_calls_of_every_style_are_intercepted():
    async def scenario():
        async with running() as server:
            engine = engine_pb2_grpc.EngineServiceStub(server.channel)
            generated = engine.Generate(engine_pb2.GenerateRequest(request_id="a b fail c"), timeout=5)
            texts = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for response in generated:
                    texts.append(response.text)
            assert texts == ["a", "b"]
            assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

            chunks = [engine_pb2.LoadExpertRequest(chunk=b"x" * n) for n in (3, 4)]
            assert (await engine.LoadExpert(iter(chunks), timeout=5)).name == "7"
            with pytest.raises(grpc.aio.AioRpcError) as empty:
                await engine.LoadExpert(iter([]), timeout=5)
            assert errors.field_violations(empty.value) == [("chunk", "the package is empty")]

            with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
                await engine.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
            assert unimplemented.value.code() is grpc.StatusCode.UNIMPLEMENTED

            inference = inference_pb2_grpc.InferenceServiceStub(server.channel)
            request = inference_pb2.InferStreamRequest(request=common_pb2.InferenceRequest(prompt="x y fail"))
            written = []
            with pytest.raises(grpc.aio.AioRpcError) as broke:
                async for response in inference.InferStream(request, timeout=5):
                    written.append(response.delta.text)
            assert written == ["x", "y"]
            assert (broke.value.code(), broke.value.details()) == (grpc.StatusCode.INTERNAL, "internal error")

    asyncio.run(scenario())


def test_client_cancellation_reaches_the_servicer_and_is_counted_as_cancelled():
    async def scenario():
        async with running() as server:
            before = rpc_count("CANCELLED")
            internal_before = rpc_count("INTERNAL")
            pending = server.router_stub.Plan(plan_request("slow", "30"))
            await asyncio.wait_for(server.router.slow_started.wait(), 5)
            pending.cancel()
            await asyncio.wait_for(server.router.cancelled.wait(), 5)
            for _ in range(100):
                if rpc_count("CANCELLED") > before:
                    break
                await asyncio.sleep(0.01)
            assert rpc_count("CANCELLED") == before + 1
            assert rpc_count("INTERNAL") == internal_before

    asyncio.run(scenario())


def test_a_call_past_its_deadline_is_counted_as_deadline_exceeded():
    async def scenario():
        async with running() as server:
            before = rpc_count("DEADLINE_EXCEEDED")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await server.router_stub.Plan(plan_request("slow", "30"), timeout=0.2)
            assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(server.router.cancelled.wait(), 5)
            for _ in range(100):
                if rpc_count("DEADLINE_EXCEEDED") > before:
                    break
                await asyncio.sleep(0.01)
            assert rpc_count("DEADLINE_EXCEEDED") == before + 1

    asyncio.run(scenario())


def test_cancelling_a_stream_closes_the_servicer_generator():
    generate = f"{ENGINE}/Generate"

    async def scenario():
        async with running() as server:
            before = rpc_count("CANCELLED", generate)
            stream = engine_pb2_grpc.EngineServiceStub(server.channel).Generate(
                engine_pb2.GenerateRequest(request_id="first wait never")
            )
            assert (await stream.read()).text == "first"
            await asyncio.wait_for(server.engine.waiting.wait(), 5)
            stream.cancel()
            await asyncio.wait_for(server.engine.closed.wait(), 5)
            for _ in range(100):
                if rpc_count("CANCELLED", generate) > before:
                    break
                await asyncio.sleep(0.01)
            assert rpc_count("CANCELLED", generate) == before + 1

    asyncio.run(scenario())


def test_the_metrics_endpoint_counts_requests_by_method_and_code():
    port = free_port()

    async def scenario():
        async with running(metrics_port=port) as server:
            await server.router_stub.Plan(plan_request("echo", "hi"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await server.router_stub.Plan(plan_request("invalid"), timeout=5)
            url = f"http://127.0.0.1:{port}/metrics"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())

    text = asyncio.run(scenario())
    assert f'expert_{SERVICE}_rpc_requests_total{{code="OK",method="{PLAN_METHOD}"}}' in text
    assert f'expert_{SERVICE}_rpc_requests_total{{code="INVALID_ARGUMENT",method="{PLAN_METHOD}"}}' in text
    assert f'expert_{SERVICE}_rpc_latency_seconds_count{{method="{PLAN_METHOD}"}}' in text


def test_the_request_id_from_metadata_is_on_every_line_of_the_call(capsys):
    configure_logging(SERVICE)

    async def scenario():
        async with running() as server:
            await server.router_stub.Plan(
                plan_request("log"), timeout=5, metadata=(("x-request-id", "req-42"),)
            )

    asyncio.run(scenario())
    lines = json_lines(capsys.readouterr().out)
    (planning,) = [line for line in lines if line["event"] == "planning"]
    (rpc,) = [line for line in lines if line["event"] == "rpc" and line.get("request_id") == "req-42"]
    assert planning["request_id"] == "req-42"
    assert (rpc["method"], rpc["code"], rpc["service"]) == (f"/{PLAN_METHOD}", "OK", SERVICE)
    assert rpc["duration_ms"] >= 0
