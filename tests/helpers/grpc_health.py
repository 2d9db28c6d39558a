"""Waiting for a gRPC server to report SERVING, for tests that start servers themselves."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.grpc_client import open_channel


async def wait_for_serving(target: str, service: str = "", timeout: float = 30.0) -> None:
    """Polls grpc.health.v1 Check on `target` until `service` ("" for the whole server) reports
    SERVING; raises TimeoutError naming the target and the last answer after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    delay = 0.05
    channel = open_channel(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                response = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(left, 1.0)
                )
            except grpc.aio.AioRpcError as error:
                last = error.code().name
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
    finally:
        await channel.close()
    what = f"service {service!r}" if service else "the server"
    raise TimeoutError(f"{target}: {what} not SERVING after {timeout:g} s (last answer: {last})")
