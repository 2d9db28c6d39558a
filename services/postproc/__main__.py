"""`python -m services.postproc`: the post-processing service."""

from __future__ import annotations

import grpc
from redis.asyncio import Redis

from libs.batching import Coalescer
from libs.gen.expert.v1 import postproc_pb2_grpc, preparation_pb2, preparation_pb2_grpc
from libs.grpc_client import call, insecure_channel
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging, get_logger
from libs.redis_streams import add_many
from services.postproc.config import PostprocConfig
from services.postproc.finalizer import Finalizer
from services.postproc.metrics import PostprocMetrics
from services.postproc.server import PostprocServicer

SERVICE = "expert.v1.PostprocService"
log = get_logger(__name__)


async def main() -> None:
    config = PostprocConfig.from_env()
    configure_logging("postproc", config.server.log_level)
    health = Health()
    redis = Redis.from_url(config.redis_url)
    channel = insecure_channel(config.preparation_target)
    preparation = preparation_pb2_grpc.PreparationServiceStub(channel)

    # Jobs that finish in the same engine step reach postproc together: their releases and their
    # feedback records each go out in one call (see libs.batching), not one call per job.
    async def release_all(job_ids: list[str]) -> None:
        try:
            await call(
                preparation.Release,
                preparation_pb2.ReleaseRequest(job_ids=job_ids),
                timeout=5.0,
                idempotent=True,
            )
        except grpc.aio.AioRpcError as exc:  # preparation forgets the jobs with their engine anyway
            log.warning("release failed", job_ids=job_ids, error=exc.details())

    async def publish_all(entries: list[tuple[str, dict[str, bytes]]]) -> None:
        await add_many(redis, entries, maxlen=100_000)

    releases = Coalescer(release_all)
    feedback = Coalescer(publish_all)

    async def publish(stream: str, fields: dict[str, bytes]) -> None:
        await feedback.submit((stream, fields))

    servicer = PostprocServicer(Finalizer(releases.submit, publish, PostprocMetrics()))

    def register(server: grpc.aio.Server) -> list[str]:
        postproc_pb2_grpc.add_PostprocServiceServicer_to_server(servicer, server)
        return [SERVICE]

    async def on_start() -> None:
        await redis.ping()  # feedback goes to Redis: not ready without it
        await health.set_serving(True)

    async def on_stop() -> None:
        await channel.close()
        await redis.aclose()

    await serve("postproc", config.server, register, health=health, on_start=on_start, on_stop=on_stop)


if __name__ == "__main__":
    run(main(), service="postproc")
