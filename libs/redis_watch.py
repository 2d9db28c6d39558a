"""Health that follows Redis: a service whose state lives in Redis is NOT_SERVING while Redis does
not answer, and SERVING again once it does and the service has restored what it keeps there (its
consumer groups: a Redis restarted without its data has none)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from libs.grpc_server import Health
from libs.logging import get_logger

log = get_logger(__name__)

PERIOD_S = 1.0
PING_TIMEOUT_S = 2.0


async def watch_redis(
    redis: Redis,
    health: Health,
    restore: Callable[[], Awaitable[None]] | None = None,
    period_s: float = PERIOD_S,
) -> None:
    """Ping Redis every `period_s` until cancelled. On the first failed ping, report NOT_SERVING;
    on the first answer after that, run `restore` (re-create groups) and report SERVING. A
    restore that fails is tried again at the next ping."""
    lost = False
    while True:
        await asyncio.sleep(period_s)
        try:
            await asyncio.wait_for(redis.ping(), PING_TIMEOUT_S)
            if lost:
                if restore is not None:
                    await restore()
                await health.set_serving(True)
                log.info("redis is back: serving again")
                lost = False
        except asyncio.CancelledError:
            raise
        except Exception as error:  # ConnectionError, TimeoutError, a failed restore
            if not lost:
                log.error("redis unreachable: not serving until it answers", error=str(error))
                await health.set_serving(False)
                lost = True
