"""The server bootstrap every service's `__main__.py` uses: a grpc.aio server with the shared
interceptors, a health service that tells the truth, reflection, the metrics endpoint, and a
graceful stop on SIGTERM or SIGINT, bounded: `grace` plus STOP_MARGIN_S after the signal, the
process exits whatever still runs.

A typical `__main__.py`:

    async def main() -> None:
        config = RouterConfig.from_env()
        configure_logging("router", config.server.log_level)
        health = Health()
        async def on_start() -> None:
            await warm_up()
            await health.set_serving(True)
        await serve("router", config.server, register, health=health, on_start=on_start)

    if __name__ == "__main__":
        run(main(), service="router")
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from libs.auth.interceptor import AuthInterceptor
from libs.auth.policy import Authenticator
from libs.config import ConfigError, ServerConfig
from libs.grpc_client import KEEPALIVE_TIME_MS, MAX_MESSAGE_BYTES
from libs.grpc_interceptors import ErrorMapper, server_interceptors
from libs.grpc_reflection import enable_reflection
from libs.logging import configure_logging, get_logger, is_configured
from libs.metrics import start_metrics_server
from libs.tls import server_credentials

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# After a stop signal, the process ends within its grace period plus this, whatever still runs: a
# service that outlives its launcher (tools.child_process) must not hold its port for minutes.
STOP_MARGIN_S = 5.0
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000
SERVER_OPTIONS: list[tuple[str, Any]] = [
    # Without this a second process could bind the same port and silently share the traffic.
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept the clients' keepalive pings (libs.grpc_client), also between calls; the default
    # minimum of 5 minutes would make the server close their connections for pinging too often.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    # Ask clients to reconnect every 5 minutes, so that their round-robin channels resolve the
    # target again and find replicas added since; calls in flight may finish (up to a day).
    ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ("grpc.max_connection_age_grace_ms", 24 * 3600 * 1000),
]

_log = get_logger(__name__)


class StartupError(RuntimeError):
    """The server could not start: its port or its metrics port is taken, or the address is invalid."""


class Health:
    """The grpc.health.v1 service of one server, for "" (the whole server) and each full service
    name it registered. It starts NOT_SERVING: the service calls `await set_serving(True)` when it
    is really ready (model loaded, peers reachable) and `set_serving(False)` when it no longer is.
    `serve` turns it NOT_SERVING for good when the server stops."""

    def __init__(self) -> None:
        self._servicer = health_aio.HealthServicer()
        self._names: list[str] = [""]
        self._serving = False

    @property
    def serving(self) -> bool:
        """What the service last declared."""
        return self._serving

    async def set_serving(self, serving: bool) -> None:
        """Reports SERVING (True) or NOT_SERVING (False) for the server and all its services."""
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._names:
            await self._servicer.set(name, status)

    async def attach(self, server: grpc.aio.Server, names: Iterable[str]) -> None:
        """Adds the health service to `server` for `names` in the state last declared (used by `serve`)."""
        self._names = ["", *names]
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        await self.set_serving(self._serving)

    async def shutdown(self) -> None:
        """NOT_SERVING for every name, for good: later `set_serving` calls are ignored."""
        self._serving = False
        await self._servicer.enter_graceful_shutdown()


async def serve(
    service: str,
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    *,
    health: Health,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    error_mapper: ErrorMapper | None = None,
    auth: Authenticator | None = None,
    grace: float = 10.0,
    stop: asyncio.Event | None = None,
    public: bool = False,
) -> None:
    """Runs the gRPC server of `service` until SIGTERM or SIGINT (or until `stop` is set), then
        stops gracefully and returns. `register(server)` adds the servicers and returns their full
        service names (e.g. "expert.v1.RouterService"); health and reflection are added for them.
        Once the server listens, `on_start` runs (cancelled if a stop comes first); it should mark the
        service SERVING when ready. On stop: NOT_SERVING, no new RPCs, in-flight RPCs get `grace`
        seconds to finish while `drain` (the service's own work in flight) runs beside them, then
        `on_stop` runs (also after a failed `on_start`, so both must tolerate a partial start).
        `error_mapper(exc)` may turn a non-ServiceError exception into a ServiceError (return None for
        INTERNAL). `auth` checks every call's credentials against the access the service declared for
        its methods (libs.auth.policy); with auth off only the levels checked in every mode are (the key
    RPCs), and with None nothing is. When auth's config
        has a TLS identity (EXPERT_TLS_*), the port is mutual TLS: a caller without a certificate from
        the CA fails the handshake, before any call. A `public` port (reception's: clients prove
        themselves with API keys) asks no certificate and stays plaintext (see
        docs/operations.md#security). Raises StartupError when a port cannot be bound."""
    checker = AuthInterceptor(auth) if auth is not None and auth.enabled else None
    server = grpc.aio.server(
        interceptors=server_interceptors(service, error_mapper, checker), options=SERVER_OPTIONS
    )
    names = list(register(server))
    await health.attach(server, names)
    enable_reflection([*names, HEALTH_SERVICE_NAME], server)
    tls = None if public or auth is None else auth.config.tls
    try:
        if tls is None:
            port = server.add_insecure_port(config.bind_address)
        else:
            port = server.add_secure_port(config.bind_address, server_credentials(tls))
    except RuntimeError:
        raise StartupError(f"cannot listen on {config.bind_address}: address in use or invalid") from None
    try:
        start_metrics_server(config.metrics_port, config.bind_host)
    except OSError as error:
        raise StartupError(f"cannot serve metrics on port {config.metrics_port}: {error.strerror}") from None

    stop = stop or asyncio.Event()
    remove_handlers = _install_signal_handlers(stop, grace + STOP_MARGIN_S)
    await server.start()
    _log.info("server started", port=port, metrics_port=config.metrics_port, services=names, tls=bool(tls))
    try:
        if on_start is not None:
            await _run_until_stopped(on_start(), stop)
        await stop.wait()
    finally:
        await health.shutdown()
        _log.info("server stopping", grace_seconds=grace)
        try:
            await asyncio.gather(server.stop(grace), drain() if drain is not None else asyncio.sleep(0))
            if on_stop is not None:
                await on_stop()
        finally:
            remove_handlers()
    _log.info("server stopped")


async def _run_until_stopped(starting: Awaitable[None], stop: asyncio.Event) -> None:
    # A SIGTERM during a long warm-up (loading a model) must not wait for the warm-up to end.
    start_task = asyncio.ensure_future(starting)
    stop_task = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({start_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
        if not start_task.done():
            start_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start_task
    if not start_task.cancelled():
        start_task.result()


def _install_signal_handlers(stop: asyncio.Event, limit_s: float) -> Callable[[], None]:
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        _log.info("signal received", signal=sig.name)
        if not stop.is_set():
            _exit_after(limit_s)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (ValueError, RuntimeError, NotImplementedError):
            # Not the main thread (an embedded server in a test): `stop` is the only way to stop.
            continue
        installed.append(sig)

    def remove() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return remove


def _exit_after(limit_s: float) -> None:
    """Ends the process `limit_s` seconds from now unless it has exited by then. Stopping may wait
    on what no cancellation reaches: a thread loading a model or compiling kernels, a peer that
    does not answer. The stacks of every thread go to the log first, to show what held it."""

    def hard_exit() -> None:
        _log.error("stop took too long; exiting now", limit_seconds=limit_s)
        sys.stdout.flush()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(limit_s, hard_exit)
    timer.daemon = True  # never what keeps the process alive
    timer.start()


def run(main: Coroutine[Any, Any, None], *, service: str = "expert") -> NoReturn:
    """Runs `main` with asyncio and exits: 0 after a clean stop, 1 after a failure. A startup error
    (ConfigError, StartupError, OSError) is logged as one line without a traceback; anything else
    is logged with its traceback inside the JSON line. `service` names the log lines when `main`
    failed before configuring logging."""
    # A crash in native code (a kernel, grpc) then leaves every thread's Python stack on stderr,
    # which is the service's log, instead of a bare exit status.
    faulthandler.enable()
    code = 0
    try:
        asyncio.run(main)
    except KeyboardInterrupt:
        # A Ctrl-C before `serve` installed its handlers: an interrupted start.
        code = 130
    except (ConfigError, StartupError, OSError) as error:
        _ensure_logging(service)
        _log.error("startup failed", error=str(error), error_type=type(error).__name__)
        code = 1
    except Exception as error:
        _ensure_logging(service)
        _log.error("service failed", error=str(error), exc_info=error)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skips the interpreter's teardown: the stop has closed what the service owns (its server,
    # clients, index), and what is left is a garbage collection over torch's and the model's
    # objects that takes one to three seconds per service and writes nothing. A stack stops its
    # services one after the other, so those seconds added up in every stop.
    os._exit(code)


def _ensure_logging(service: str) -> None:
    if not is_configured():
        configure_logging(service)
