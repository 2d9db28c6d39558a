"""The HTTP front's server: uvicorn inside reception's own process and event loop."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket

import uvicorn
from fastapi import FastAPI

from libs.config import ServerConfig
from libs.grpc_server import StartupError
from libs.logging import get_logger
from services.reception.http.calls import cut_off

log = get_logger(__name__)

# uvicorn cancels the requests still running when its grace ends, and a cancelled call is answered
# with a plain-text 500: the calls still waiting are cut off (calls.py) this long before that, and
# answer with their job's id, which needs nothing but the call itself.
ANSWER_MARGIN_S = 1.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside reception's event loop: the gRPC bootstrap owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The HTTP front on `config.bind_host`:`port`, started and stopped by reception's serve hooks."""

    def __init__(self, app: FastAPI, config: ServerConfig, port: int, grace_s: float) -> None:
        self.app, self.host, self.port, self.grace_s = app, config.bind_host, port, grace_s
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self._socket: socket.socket | None = None

    def bind(self) -> None:
        """Take the port now (StartupError when it is taken), so that a busy port fails the start."""
        host = self.host.strip("[]")
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
        except (OSError, socket.gaierror) as error:
            raise StartupError(f"cannot serve HTTP on {self.host}:{self.port}: {error}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(2048)
        except OSError as error:
            sock.close()
            raise StartupError(f"cannot serve HTTP on port {self.port}: {error.strerror}") from None
        sock.setblocking(False)
        self._socket = sock

    async def start(self) -> None:
        if self._socket is None:
            self.bind()
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=math.ceil(self.grace_s + ANSWER_MARGIN_S),
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its failure
                raise StartupError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP server started", port=self.port)

    async def stop(self) -> None:
        """Stop accepting, let the requests in flight end within the grace, answer those still
        waiting then (calls.py's cut-off), close."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            answer_the_rest = asyncio.get_running_loop().call_later(self.grace_s, cut_off(self.app).set)
            try:
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            finally:
                answer_the_rest.cancel()
            self._server = self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
