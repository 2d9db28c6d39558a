"""Redis clients as every service opens them, and what a Redis failure looks like to a caller.

A redis-py client keeps pooled connections; when Redis restarts, the first command on each old
connection fails ("Connection closed by server") although Redis is back. The clients here retry
a command on a connection or timeout error a few times, on a fresh connection, with a short backoff:
a command that never reached Redis (the usual case after a restart) then simply runs. The scripts
that end or change a job check its state first, so running one twice changes nothing more.

A Redis that stays unreachable is an UNAVAILABLE answer (safe to retry), never an INTERNAL one.
"""

from __future__ import annotations

import redis
import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.errors import ServiceError, unavailable

RETRIES = 3  # about 0.05 + 0.1 + 0.2 s of backoff: a restart's stale connections, not an outage
# Connections one client may open. redis-py 8 caps a pool at 100 and refuses the next command at
# once (MaxConnectionsError): every job a reception follows holds a connection for its blocking
# XREAD, so past 100 jobs in flight it answered UNAVAILABLE (bench/soak.py saw it). Redis's own
# default maxclients is 10,000, shared by every service.
MAX_CONNECTIONS = 2048
_ERRORS = [RedisConnectionError, RedisTimeoutError]


def connect(url: str) -> redis.asyncio.Redis:
    """An asyncio client for `url` that retries commands across a Redis restart."""
    retry = redis.asyncio.retry.Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)
    return redis.asyncio.Redis.from_url(
        url, retry=retry, retry_on_error=_ERRORS, max_connections=MAX_CONNECTIONS
    )


def connect_sync(url: str) -> redis.Redis:
    """The same for code that runs on executor threads."""
    retry = redis.retry.Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)
    return redis.Redis.from_url(url, retry=retry, retry_on_error=_ERRORS, max_connections=MAX_CONNECTIONS)


def map_redis_error(error: BaseException) -> ServiceError | None:
    """An error mapper for serve(): Redis unreachable is UNAVAILABLE with what to do."""
    if isinstance(error, RedisConnectionError | RedisTimeoutError):
        return unavailable(f"Redis is unreachable ({error}); retry shortly")
    return None
