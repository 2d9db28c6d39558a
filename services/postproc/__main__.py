"""`python -m services.postproc`: the post-processing service."""

from __future__ import annotations

import asyncio

import grpc

from libs.auth.policy import Authenticator
from libs.batching import Coalescer
from libs.gen.expert.v1 import postproc_pb2_grpc
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging
from libs.redis_client import connect, map_redis_error
from libs.redis_streams import add_many
from libs.redis_watch import watch_redis
from services.postproc.config import PostprocConfig
from services.postproc.finalizer import Finalizer
from services.postproc.metrics import PostprocMetrics
from services.postproc.server import PostprocServicer

SERVICE = "expert.v1.PostprocService"


async def main() -> None:
    config = PostprocConfig.from_env()
    configure_logging("postproc", config.server.log_level)
    health = Health()
    redis = connect(config.redis_url)

    # Jobs that finish in the same engine step reach postproc together: their feedback records go
    # out in one call (see libs.batching), not one call per job.
    async def publish_all(entries: list[tuple[str, dict[str, bytes]]]) -> None:
        await add_many(redis, entries, maxlen=100_000)

    feedback = Coalescer(publish_all)

    async def publish(stream: str, fields: dict[str, bytes]) -> None:
        await feedback.submit((stream, fields))

    servicer = PostprocServicer(Finalizer(publish, PostprocMetrics()))

    def register(server: grpc.aio.Server) -> list[str]:
        postproc_pb2_grpc.add_PostprocServiceServicer_to_server(servicer, server)
        return [SERVICE]

    background: set[asyncio.Task] = set()

    async def on_start() -> None:
        await redis.ping()  # feedback goes to Redis: not ready without it
        await health.set_serving(True)
        background.add(asyncio.create_task(watch_redis(redis, health)))

    async def on_stop() -> None:
        for task in background:
            task.cancel()
        await redis.aclose()

    await serve(
        "postproc",
        config.server,
        register,
        health=health,
        on_start=on_start,
        on_stop=on_stop,
        error_mapper=map_redis_error,
        auth=Authenticator(config.auth, {}),  # Finalize is internal (the default)
    )


if __name__ == "__main__":
    run(main(), service="postproc")
