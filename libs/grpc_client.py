"""Calling other services: channels with the options every peer expects, deadline propagation,
retries of idempotent calls on UNAVAILABLE, and waiting for a peer to report SERVING.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A ping every 30 s finds a dead peer (or a NAT that dropped the connection) between calls; the
# server side accepts pings this frequent (see libs.grpc_server.SERVER_OPTIONS).
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

CHANNEL_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    # Keep pinging an idle connection instead of stopping after two pings without data.
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that was down is retried at least every 5 s (gRPC's default backoff grows to 120 s,
    # so a long outage would keep calls failing for minutes after the peer is back).
    ("grpc.max_reconnect_backoff_ms", 5_000),
)
# Spread calls over every address the target resolves to: a headless Kubernetes Service (or a
# compose service with replicas) resolves to one address per replica, and with the default
# pick_first every call of a channel would go to the first of them.
BALANCED_OPTIONS: Sequence[tuple[str, Any]] = (("grpc.lb_policy_name", "round_robin"),)

# Backoff between attempts of `call`: full jitter over an exponentially growing window.
_BACKOFF_BASE_S = 0.1
_BACKOFF_MAX_S = 2.0


def insecure_channel(target: str, *, balanced: bool = True) -> grpc.aio.Channel:
    """An aio channel to `target` (host:port) with keepalive and 64 MiB message limits, round-robin
    over the target's addresses unless `balanced` is False (a channel to one particular replica,
    such as an engine at the address it registered). Create one per peer and reuse it; close it
    with `await channel.close()`."""
    options = [*CHANNEL_OPTIONS, *(BALANCED_OPTIONS if balanced else ())]
    return grpc.aio.insecure_channel(target, options=options)


async def call(
    method: grpc.aio.UnaryUnaryMultiCallable,
    request: Any,
    *,
    timeout: float | None,
    idempotent: bool,
    attempts: int = 3,
    metadata: Sequence[tuple[str, str | bytes]] | None = None,
) -> Any:
    """Calls a unary `method` (e.g. `stub.Plan`) and returns its response. When `idempotent`, an
    UNAVAILABLE answer is retried up to `attempts` calls in all, with jittered exponential backoff;
    `timeout` bounds all attempts together and no attempt or wait goes past it. Any other error,
    and UNAVAILABLE from a non-idempotent call, is raised at once (a grpc.aio.AioRpcError)."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    deadline = None if timeout is None else time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return await method(request, timeout=left, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            if not idempotent or error.code() is not grpc.StatusCode.UNAVAILABLE or attempt >= attempts:
                raise
            delay = random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** (attempt - 1)))
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise
            await asyncio.sleep(delay)
