"""A TLS-terminating gRPC proxy in front of reception, as a deployment's ingress is: reception's client
port is plaintext (docs/operations.md#security), so clients reach it over TLS only through such a
proxy. It serves mutual TLS with a certificate of the stack's CA (asking the client for one of the
same CA) and forwards every call, whatever its method, as raw bytes to the plaintext target, with
its metadata, deadline, status, details and trailers (grpc-status-details-bin: the field violations)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator

import grpc

from libs.config import TlsConfig
from libs.tls import server_credentials
from tests.helpers.ports import free_port

# What a proxy sets itself on the call it makes, so not copied from the incoming one.
_OWN_METADATA = ("user-agent", "grpc-accept-encoding", "grpc-timeout")


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method

        async def forward(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
            metadata = [(k, v) for k, v in context.invocation_metadata() if k not in _OWN_METADATA]
            call = self.channel.stream_stream(method)(
                requests, metadata=metadata, timeout=context.time_remaining()
            )
            try:
                async for response in call:
                    yield response
                context.set_trailing_metadata(await call.trailing_metadata())
            except grpc.aio.AioRpcError as error:
                context.set_trailing_metadata(error.trailing_metadata() or ())
                await context.abort(error.code(), error.details() or "")

        return grpc.stream_stream_rpc_method_handler(forward)


@contextlib.contextmanager
def tls_ingress(target: str, tls: TlsConfig) -> Iterator[str]:
    """A proxy to the plaintext `target` on a free 127.0.0.1 port, serving mutual TLS with `tls`
    (its certificate, and the CA a client's certificate must come from); yields its host:port."""
    port = free_port()
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()
    failure: list[BaseException] = []

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            server = grpc.aio.server(handlers=[_Forward(channel)])
            server.add_secure_port(f"127.0.0.1:{port}", server_credentials(tls))
            await server.start()
            started.set()
            await stop.wait()
            await server.stop(1)

    def main() -> None:
        try:
            loop.run_until_complete(run())
        except BaseException as error:  # handed to the test, which fails with it
            failure.append(error)
            started.set()

    thread = threading.Thread(target=main, name="tls-ingress", daemon=True)
    thread.start()
    started.wait(30)
    if failure:
        raise failure[0]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
