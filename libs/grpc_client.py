"""Calling other services: channels with the options every peer expects (mutual TLS when the
service has a certificate), one shared channel per peer, deadline propagation and retries of
idempotent calls on UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc

from libs.auth.metadata import internal_token_interceptors
from libs.config import TlsConfig
from libs.logging import get_logger
from libs.tls import ENGINE_TLS_NAME, channel_credentials, may_send_token

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
# A channel to one replica keeps its connections to itself. gRPC shares a subchannel between the
# channels of a process that have the same target and options, so the channel that replaces one in
# TRANSIENT_FAILURE (Channels.replica) would otherwise inherit its reconnect backoff and fail at once
# with "connection refused" while the restarted replica is already listening.
REPLICA_OPTIONS: Sequence[tuple[str, Any]] = (("grpc.use_local_subchannel_pool", 1),)

# Backoff between attempts of `call`: full jitter over an exponentially growing window.
_BACKOFF_BASE_S = 0.1
_BACKOFF_MAX_S = 2.0
_LAST_ATTEMPT_S = 0.5  # what the last attempt of a call is left of its deadline or patience, at most

_log = get_logger(__name__)


def open_channel(
    target: str, *, balanced: bool = True, internal_token: str = "", tls: TlsConfig | None = None
) -> grpc.aio.Channel:
    """An aio channel to `target` (host:port) with keepalive and 64 MiB message limits, round-robin
    over the target's addresses unless `balanced` is False (a channel to one particular replica: an
    engine at the address it registered, whose certificate must name ENGINE_TLS_NAME). With `tls`
    it is mutual TLS: it presents the service's certificate and accepts only a peer certified by the
    CA for the name dialled. Every call sends `internal_token` when one is given (EXPERT_INTERNAL_TOKEN:
    how services prove they are services), but only where libs.tls.may_send_token allows: inside
    TLS, or to a loopback address; elsewhere the calls go without it (and the peer, if it checks,
    refuses them). Create one per peer and reuse it; close it with `await channel.close()`."""
    options = [*CHANNEL_OPTIONS, *(BALANCED_OPTIONS if balanced else REPLICA_OPTIONS)]
    if internal_token and not may_send_token(target, tls):
        _log.warning("internal token withheld: neither TLS nor a loopback address", target=target)
        internal_token = ""
    interceptors = internal_token_interceptors(internal_token) if internal_token else None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    if not balanced:
        options.append(("grpc.ssl_target_name_override", ENGINE_TLS_NAME))
    credentials = channel_credentials(tls)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


class Channels:
    """The channels a process keeps to its peers, opened once per target and shared by all callers.

    `service(name)` is a channel to a service, round-robin over its replicas. `replica(address)` is
    a channel to one replica at the address it registered (an engine). Engines come and go: a
    channel whose replica failed waits out a reconnect backoff before it tries again, so when a
    replica is asked for again (it was placed on or registered anew, so it is back), a channel in
    TRANSIENT_FAILURE is replaced by a new one that connects at once. The old one closes in the
    background once the calls still on it end."""

    RETIRE_GRACE_S = 60.0

    def __init__(self, internal_token: str = "", tls: TlsConfig | None = None) -> None:
        self._internal_token = internal_token  # sent on every call (see open_channel)
        self._tls = tls  # mutual TLS on every channel when set
        self._open: dict[tuple[str, bool], grpc.aio.Channel] = {}
        self._retiring: dict[grpc.aio.Channel, asyncio.Task[None]] = {}

    def service(self, target: str) -> grpc.aio.Channel:
        return self._get(target, balanced=True)

    def replica(self, address: str) -> grpc.aio.Channel:
        channel = self._open.get((address, False))
        if channel is not None and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            del self._open[(address, False)]
            self._retiring[channel] = asyncio.get_running_loop().create_task(self._retire(channel))
        return self._get(address, balanced=False)  # one replica: nothing to balance over

    def _get(self, target: str, *, balanced: bool) -> grpc.aio.Channel:
        channel = self._open.get((target, balanced))
        if channel is None:
            channel = self._open[(target, balanced)] = open_channel(
                target, balanced=balanced, internal_token=self._internal_token, tls=self._tls
            )
        return channel

    async def _retire(self, channel: grpc.aio.Channel) -> None:
        try:
            await channel.close(grace=self.RETIRE_GRACE_S)
        finally:
            self._retiring.pop(channel, None)

    async def close(self) -> None:
        """Close every channel, cancelling the calls still on them."""
        channels = [*self._open.values(), *self._retiring]
        tasks = list(self._retiring.values())
        self._open = {}
        for channel in channels:
            await channel.close()
        await asyncio.gather(*tasks, return_exceptions=True)


async def call(
    method: grpc.aio.UnaryUnaryMultiCallable,
    request: Any,
    *,
    timeout: float | None,
    idempotent: bool,
    attempts: int = 3,
    patience_s: float | None = None,
    metadata: Sequence[tuple[str, str | bytes]] | None = None,
) -> Any:
    """Calls a unary `method` (e.g. `stub.Plan`) and returns its response. When `idempotent`, an
    UNAVAILABLE answer is retried with jittered exponential backoff: up to `attempts` calls in all,
    or, with `patience_s`, for as long as that many seconds after the first call (a peer being
    restarted or rolled out is waited for). `timeout` bounds all attempts together and no attempt
    or wait goes past it. Any other error, and UNAVAILABLE from a non-idempotent call, is raised at
    once (a grpc.aio.AioRpcError). This is the only retry of a call: callers do not loop on it."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    attempt = 0
    while True:
        attempt += 1
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return await method(request, timeout=left, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            if not idempotent or error.code() is not grpc.StatusCode.UNAVAILABLE:
                raise
            if patience_s is None and attempt >= attempts:
                raise
            delay = random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** (attempt - 1)))
            # The wait is cut short at the limit rather than given up: the last attempt goes when
            # _LAST_ATTEMPT_S of the deadline (or the patience) is left, so "retried until the
            # deadline" holds to within that, not to within a whole backoff window.
            limits = [deadline] if deadline is not None else []
            if patience_s is not None:
                limits.append(started + patience_s)
            if limits:
                limit = min(limits)
                reserve = min(_LAST_ATTEMPT_S, 0.1 * (limit - started))  # a short call keeps its retries
                room = limit - reserve - time.monotonic()
                if room <= 0:
                    raise
                delay = min(delay, room)
            await asyncio.sleep(delay)
