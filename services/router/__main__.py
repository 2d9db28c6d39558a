"""`python -m services.router`: the router service."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import torch

from libs.auth.keys import KeyStore
from libs.auth.policy import Access, Authenticator, methods
from libs.gen.expert.v1 import router_pb2_grpc
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging
from libs.redis_client import connect, connect_sync, map_redis_error
from libs.redis_watch import watch_redis
from services.router.config import RouterConfig
from services.router.embedding import SentenceEncoder
from services.router.features import language_model
from services.router.feedback import FeedbackLearner
from services.router.index import ExpertIndex
from services.router.metrics import RouterMetrics
from services.router.planner import Planner
from services.router.registry import Registry
from services.router.server import RouterServicer
from services.router.stats import ExpertStats

SERVICE = "expert.v1.RouterService"
# Plan is internal (the default); the registry is the operator's (`expertctl experts`).
ACCESS = methods(
    SERVICE,
    {
        "RegisterExpert": Access.ADMIN,
        "UnregisterExpert": Access.ADMIN,
        "GetRegisteredExpert": Access.ADMIN,
        "ListRegisteredExperts": Access.ADMIN,
    },
)


async def main() -> None:
    config = RouterConfig.from_env()
    configure_logging("router", config.server.log_level)
    # One short prompt is too small a matrix for several threads to help: one thread encodes it as
    # fast as two here, and an executor thread with two waits on the other (21 ms instead of 13).
    # Concurrent plans encode on their own executor threads.
    torch.set_num_threads(config.encoder_threads)
    health = Health()
    # The expert index: the sentence encoder and Qdrant (embedded under the data directory, or a
    # server), opened before serving so that a broken index stops start-up with its reason.
    client = ExpertIndex.connect(data_dir=config.data_dir, url=config.qdrant_url or None)
    # The feedback statistics: a synchronous client, used on the executor threads that select.
    stats_redis = connect_sync(config.redis_url)
    stats = ExpertStats(stats_redis, config.prior_success_rate)
    index = ExpertIndex(client, SentenceEncoder.from_package(), stats, config.floor, matching=config.matching)
    servicer = RouterServicer(Planner(index, config.max_tokens_ceiling), RouterMetrics(), Registry(index))
    feedback_redis = connect(config.redis_url)
    learner = FeedbackLearner(feedback_redis, index, config.feedback_alpha)
    learning: asyncio.Task | None = None

    def register(server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
        return [SERVICE]

    background: set[asyncio.Task] = set()

    async def on_start() -> None:
        nonlocal learning
        await _warm_up(servicer.planner, index)
        await feedback_redis.ping()  # feedback comes from Redis: not ready without it
        learning = asyncio.create_task(learner.run())
        await health.set_serving(True)
        watch = asyncio.create_task(watch_redis(feedback_redis, health, restore=learner.restore))
        background.add(watch)

    async def on_stop() -> None:
        for task in background:
            task.cancel()
        if learning is not None:
            learning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await learning
        await feedback_redis.aclose()
        stats_redis.close()
        client.close()

    await serve(
        "router",
        config.server,
        register,
        health=health,
        on_start=on_start,
        on_stop=on_stop,
        error_mapper=map_redis_error,
        auth=Authenticator(config.auth, ACCESS, KeyStore(feedback_redis)),
    )


async def _warm_up(planner: Planner, index: ExpertIndex) -> None:
    """Loads the language model, runs the encoder once and encodes the floors' background corpus
    before the first job."""
    language_model()
    await planner.plan(_warm_up_request())
    index.encoder.encode(["Warm up the router."])
    if index.floor.fixed is None:
        await asyncio.to_thread(lambda: index.background.vectors)


def _warm_up_request():
    from libs.gen.expert.v1 import common_pb2

    return common_pb2.InferenceRequest(prompt="Warm up the router.")


if __name__ == "__main__":
    run(main(), service="router")
