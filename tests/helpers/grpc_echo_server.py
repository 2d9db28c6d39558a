"""A tiny service built on libs.grpc_server, run as a subprocess by the server tests
(`python -m tests.helpers.grpc_echo_server`): RouterService.Plan echoes the prompt, and the job
"slow" first sleeps for as many seconds as its prompt says. Configured like every service:
EXPERT_ECHOTEST_PORT, EXPERT_ECHOTEST_METRICS_PORT, EXPERT_BIND_HOST, EXPERT_LOG_LEVEL; and for
the tests of start-up, ECHOTEST_WARM_UP_SECONDS (a slow warm-up) and ECHOTEST_FAIL_WARM_UP=1; for
those of stopping, ECHOTEST_STOP_HANG_SECONDS (on_stop blocks the whole process that long, as a
join on a thread that does not end would)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from libs.config import ServerConfig
from libs.gen.expert.v1 import common_pb2, router_pb2, router_pb2_grpc
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging, get_logger

SERVICE = "echotest"
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name

_log = get_logger(__name__)


class EchoRouter(router_pb2_grpc.RouterServiceServicer):
    async def Plan(self, request: router_pb2.PlanRequest, context: grpc.aio.ServicerContext):
        if request.job_id == "slow":
            _log.info("slow plan started")
            await asyncio.sleep(float(request.request.prompt))
        return router_pb2.PlanResponse(plan=common_pb2.ExpertPlan(prompt_modified=request.request.prompt))


async def main() -> None:
    config = ServerConfig.from_env(SERVICE, 50099, 0)
    configure_logging(SERVICE, config.log_level)
    health = Health()

    def register(server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(EchoRouter(), server)
        return [ROUTER_SERVICE]

    async def on_start() -> None:
        _log.info("warm-up started")
        await asyncio.sleep(float(os.environ.get("ECHOTEST_WARM_UP_SECONDS", "0")))
        if os.environ.get("ECHOTEST_FAIL_WARM_UP") == "1":
            raise RuntimeError("warm-up failed")
        await health.set_serving(True)

    async def on_stop() -> None:
        _log.info("on_stop ran")
        time.sleep(float(os.environ.get("ECHOTEST_STOP_HANG_SECONDS", "0")))

    await serve(SERVICE, config, register, health=health, on_start=on_start, on_stop=on_stop, grace=5.0)


if __name__ == "__main__":
    run(main(), service=SERVICE)
