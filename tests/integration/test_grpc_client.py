"""libs.grpc_client against real servers: retries of idempotent calls on UNAVAILABLE only, never
past the deadline, the deadline of an incoming call carried to the next one, and calls spread over
the replicas a target resolves to."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from libs.gen.expert.v1 import router_pb2, router_pb2_grpc
from libs.grpc_client import Channels, call, open_channel
from tests.helpers.grpc_services import plan_request, running
from tests.helpers.in_process import serving
from tools.stack import free_port


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


def test_call_with_patience_waits_for_a_peer_for_that_long_however_many_attempts_it_takes():
    async def scenario():
        async with running() as server:
            plan, calls = server.router_stub.Plan, server.router.calls
            response = await call(
                plan, plan_request("flaky", "5", "e"), timeout=10, idempotent=True, attempts=1, patience_s=5
            )
            assert response.plan.prompt_modified == "5" and calls["e"] == 6

            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(
                    plan, plan_request("flaky", "1000", "f"), timeout=10, idempotent=True, patience_s=0.5
                )
            assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - start < 0.9 and calls["f"] > 1

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
            async with open_channel(target) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                await channel.channel_ready()
                for _ in range(20):
                    await call(stub.Plan, router_pb2.PlanRequest(), timeout=5, idempotent=True)
        assert sum(r.calls for r in replicas) == 20
        assert all(r.calls >= 5 for r in replicas), [r.calls for r in replicas]

    asyncio.run(scenario())


async def _replica(port: int) -> tuple[grpc.aio.Server, _Counting]:
    servicer, server = _Counting(), grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, servicer


def test_channels_are_shared_and_a_failed_replica_channel_is_replaced_when_asked_for_again():
    """An engine restarted at its address is reached at once through a new channel, instead of
    waiting out the old channel's reconnect backoff; the old channel closes by itself."""

    async def scenario():
        port, channels = free_port(), Channels()
        address = f"127.0.0.1:{port}"
        first, _ = await _replica(port)
        channel = channels.replica(address)
        assert channels.replica(address) is channel and channels.service(address) is not channel
        assert channels.service(address) is channels.service(address)
        await router_pb2_grpc.RouterServiceStub(channel).Plan(router_pb2.PlanRequest(), timeout=5)

        await first.stop(None)
        with pytest.raises(grpc.aio.AioRpcError):
            await router_pb2_grpc.RouterServiceStub(channel).Plan(router_pb2.PlanRequest(), timeout=5)
        for _ in range(100):
            if channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                break
            await asyncio.sleep(0.05)
        assert channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE

        second, servicer = await _replica(port)
        fresh = channels.replica(address)
        assert fresh is not channel
        await router_pb2_grpc.RouterServiceStub(fresh).Plan(router_pb2.PlanRequest(), timeout=1)
        assert servicer.calls == 1
        await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.UsageError):  # the replaced channel was closed
            await router_pb2_grpc.RouterServiceStub(channel).Plan(router_pb2.PlanRequest(), timeout=1)
        await channels.close()
        with pytest.raises(grpc.aio.UsageError):
            await router_pb2_grpc.RouterServiceStub(fresh).Plan(router_pb2.PlanRequest(), timeout=1)
        await second.stop(None)

    asyncio.run(scenario())
