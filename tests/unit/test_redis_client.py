"""libs.redis_client: clients that retry across a Redis restart, and Redis failures answered as
UNAVAILABLE (safe to retry) instead of INTERNAL."""

from __future__ import annotations

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.redis_client import RETRIES, connect, connect_sync, map_redis_error


def test_an_unreachable_redis_is_unavailable_and_other_errors_are_left_alone():
    for error in (RedisConnectionError("Connection closed by server."), RedisTimeoutError("timed out")):
        mapped = map_redis_error(error)
        assert mapped.code is grpc.StatusCode.UNAVAILABLE and "retry" in mapped.message
    assert map_redis_error(ResponseError("WRONGTYPE")) is None
    assert map_redis_error(ValueError("x")) is None


def test_both_clients_retry_connection_and_timeout_errors():
    asynchronous = connect("redis://127.0.0.1:1/0")
    kwargs = asynchronous.connection_pool.connection_kwargs
    assert kwargs["retry"]._retries == RETRIES
    assert set(kwargs["retry_on_error"]) == {RedisConnectionError, RedisTimeoutError}
    assert connect_sync("redis://127.0.0.1:1/0").get_retry()._retries == RETRIES
