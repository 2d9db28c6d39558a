"""Real service objects served in-process, for tests that need to hold a stage at a chosen moment.

Each service's metrics register in prometheus_client's default registry, which refuses a second
registration of a name, so one instance per metrics class is shared by the whole test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

import grpc

from libs.config import ServerConfig
from libs.grpc_server import Health, serve
from tools.stack import free_port


@functools.cache
def shared_metrics(cls: type):
    return cls()


def preparation_parts(store_dir: Path, heartbeat_timeout_s: float = 60.0):
    """A fleet and the preparer over it, staging from the expert store at `store_dir`."""
    from libs.experts.store import ExpertStore
    from services.preparation.fleet import Fleet
    from services.preparation.metrics import PreparationMetrics
    from services.preparation.preparer import Preparer
    from services.preparation.staging import Stager

    fleet, metrics = Fleet(heartbeat_timeout_s), shared_metrics(PreparationMetrics)
    return fleet, Preparer(fleet, Stager(ExpertStore(store_dir), metrics), metrics), metrics


@contextlib.asynccontextmanager
async def serving(register: Callable[[grpc.aio.Server], list[str]], error_mapper=None, auth=None):
    """A real serve() with what `register` adds (and the service's `error_mapper` and
    Authenticator, if it has them), on a free port; yields its target."""
    health, stop = Health(), asyncio.Event()
    config = ServerConfig(bind_host="127.0.0.1", port=free_port(), metrics_port=0, log_level="info")

    async def on_start() -> None:
        await health.set_serving(True)

    task = asyncio.create_task(
        serve(
            "inprocess",
            config,
            register,
            health=health,
            on_start=on_start,
            grace=1.0,
            stop=stop,
            error_mapper=error_mapper,
            auth=auth,
        )
    )
    target = f"127.0.0.1:{config.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        ready = asyncio.ensure_future(channel.channel_ready())
        await asyncio.wait({ready, task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        assert ready.done(), "the in-process server did not start within 10 s"
    try:
        yield target
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
