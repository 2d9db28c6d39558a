"""libs.grpc_client against real servers: retries of idempotent calls on UNAVAILABLE only, never
past the deadline, the deadline of an incoming call carried to the next one, and calls spread over
the replicas a target resolves to."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from libs.gen.expert.v1 import router_pb2, router_pb2_grpc
from libs.grpc_client import call, insecure_channel
from tests.helpers.grpc_services import plan_request, running
from tests.helpers.in_process import serving


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


class _Counting(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Plan(self, request, context):
        self.calls += 1
        return router_pb2.PlanResponse()


def test_a_channel_spreads_its_calls_over_every_address_of_its_target():
    """Two replicas behind one target (as a headless Service resolves): both get calls."""

    async def scenario():
        replicas = [_Counting(), _Counting()]

        def registrar(servicer):
            def register(server: grpc.aio.Server) -> list[str]:
                router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
                return ["expert.v1.RouterService"]

            return register

        async with serving(registrar(replicas[0])) as first, serving(registrar(replicas[1])) as second:
            target = "ipv4:" + ",".join([first, second])
            async with insecure_channel(target) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                await channel.channel_ready()
                for _ in range(20):
                    await call(stub.Plan, router_pb2.PlanRequest(), timeout=5, idempotent=True)
        assert sum(r.calls for r in replicas) == 20
        assert all(r.calls >= 5 for r in replicas), [r.calls for r in replicas]

    asyncio.run(scenario())
