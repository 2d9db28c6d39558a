"""libs.grpc_client against a real server: retries of idempotent calls on UNAVAILABLE only, never
past the deadline, and the deadline of an incoming call carried to the next one."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from libs.grpc_client import call
from tests.helpers.grpc_services import plan_request, running


def test_call_retries_unavailable_only_when_idempotent():
    async def scenario():
        async with running() as server:
            plan, calls = server.router_stub.Plan, server.router.calls
            response = await call(plan, plan_request("flaky", "2", "a"), timeout=10, idempotent=True)
            assert response.plan.prompt_modified == "2"
            assert calls["a"] == 3

            with pytest.raises(grpc.aio.AioRpcError) as once:
                await call(plan, plan_request("flaky", "2", "b"), timeout=10, idempotent=False)
            assert once.value.code() is grpc.StatusCode.UNAVAILABLE
            assert calls["b"] == 1

            with pytest.raises(grpc.aio.AioRpcError):
                await call(plan, plan_request("flaky", "5", "c"), timeout=10, idempotent=True, attempts=2)
            assert calls["c"] == 2

            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await call(plan, plan_request("invalid"), timeout=10, idempotent=True)
            assert invalid.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(scenario())


def test_call_never_retries_past_its_deadline():
    async def scenario():
        async with running() as server:
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(
                    server.router_stub.Plan,
                    plan_request("flaky", "1000", "d"),
                    timeout=0.5,
                    idempotent=True,
                    attempts=1000,
                )
            elapsed = time.monotonic() - start
            assert raised.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert elapsed < 0.9
            assert server.router.calls["d"] > 1

    asyncio.run(scenario())


def test_the_deadline_propagates_to_the_next_call():
    async def scenario():
        async with running() as server:
            stub = server.router_stub
            assert (await stub.Plan(plan_request("remaining"))).plan.router_latency_ms == 99.0
            direct = (await stub.Plan(plan_request("remaining"), timeout=5)).plan.router_latency_ms
            # gRPC rounds deadlines a little up, hence the slack above the timeouts.
            assert 4 < direct < 5.1
            forwarded = (await stub.Plan(plan_request("forward"), timeout=2)).plan.router_latency_ms
            assert 1 < forwarded < 2.1
            without_deadline = (await stub.Plan(plan_request("forward"))).plan.router_latency_ms
            assert 29 < without_deadline < 30.1

    asyncio.run(scenario())
