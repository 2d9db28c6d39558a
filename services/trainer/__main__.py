"""`python -m services.trainer`: the trainer worker, with gRPC health (SERVING while Redis answers
and the worker loop runs) and /metrics like the other services."""

from __future__ import annotations

import asyncio

import grpc

from libs.auth.policy import Authenticator
from libs.gen.expert.v1 import router_pb2_grpc
from libs.grpc_client import open_channel
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging, get_logger
from libs.redis_client import connect, map_redis_error
from libs.redis_watch import watch_redis
from libs.training.files import TrainingFiles
from libs.training.jobs import TrainingJobs
from libs.training.queue import TrainingQueue
from services.trainer.checkpoint_sweep import CheckpointSweeper
from services.trainer.config import TrainerConfig
from services.trainer.metrics import TrainerMetrics
from services.trainer.runner import JobRunner
from services.trainer.worker import Worker

log = get_logger(__name__)


async def main() -> None:
    config = TrainerConfig.from_env()
    configure_logging("trainer", config.server.log_level)
    health = Health()
    redis = connect(config.redis_url)
    router_channel = open_channel(
        config.router_target, internal_token=config.auth.internal_token, tls=config.auth.tls
    )
    jobs = TrainingJobs(redis, config.job_retention_s)
    router = router_pb2_grpc.RouterServiceStub(router_channel)
    runner = JobRunner(config, jobs, TrainingFiles(redis), router, TrainerMetrics())
    worker = Worker(
        TrainingQueue(redis, config.consumer, config.lease_ms),
        jobs,
        runner,
        config.max_deliveries,
        CheckpointSweeper(config.checkpoint_dir, jobs, config.job_retention_s),
    )
    background: set[asyncio.Task] = set()
    loops: list[asyncio.Task] = []  # the worker's loop, once started

    def register(server: grpc.aio.Server) -> list[str]:
        return []  # health only: the trainer takes its work from Redis, not from calls

    async def on_start() -> None:
        await redis.ping()
        await asyncio.to_thread(_load_training_libraries)  # before SERVING, not in the first job
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.create_task(worker.run())
        loop.add_done_callback(_log_end)
        loops.append(loop)
        background.update({loop, asyncio.create_task(watch_redis(redis, health))})
        await health.set_serving(True)
        log.info("trainer ready", consumer=config.consumer, checkpoint_dir=str(config.checkpoint_dir))

    async def drain() -> None:
        worker.stop()  # the running job checkpoints after its step and is handed back
        if loops:
            await asyncio.wait(loops, timeout=config.lease_ms / 1000)

    async def on_stop() -> None:
        for task in background:
            task.cancel()
        await router_channel.close()
        await redis.aclose()

    await serve(
        "trainer",
        config.server,
        register,
        health=health,
        on_start=on_start,
        drain=drain,
        on_stop=on_stop,
        error_mapper=map_redis_error,
        auth=Authenticator(config.auth, {}),
        grace=config.lease_ms / 1000,
    )


def _load_training_libraries() -> None:
    import peft  # noqa: F401
    import transformers  # noqa: F401


def _log_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the trainer loop ended", error=repr(task.exception()))


if __name__ == "__main__":
    run(main(), service="trainer")
