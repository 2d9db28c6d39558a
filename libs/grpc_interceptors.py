"""The server interceptors every service runs: logging, metrics and error mapping, for all four RPC
kinds (unary-unary, unary-stream, stream-unary, stream-stream).

Each interceptor wraps the servicer method in an async context manager (its "scope") that sees the
call start and end, and how it ended. `server_interceptors` returns them in the order they must
nest: logging outermost (so `request_id` is bound while anything inside logs), then metrics, then
error mapping (so the others observe the status the client will receive), then, when auth is on,
the credentials check (libs.auth.interceptor) innermost, so its refusals are logged, counted and
sent as statuses like any other error.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from libs.errors import ServiceError, to_status
from libs.logging import bind_context, get_logger
from libs.metrics import rpc_metrics

ErrorMapper = Callable[[BaseException], ServiceError | None]
Scope = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]

INTERNAL_MESSAGE = "internal error"
REQUEST_ID_KEY = "x-request-id"

_log = get_logger(__name__)
# Health checks and reflection come every few seconds from probes, the dispatchers poll capacity
# and the engines heartbeat: not worth an info line each (they still log at debug, and errors).
_QUIET_PREFIXES = (
    "/grpc.health.v1.",
    "/grpc.reflection.",
    "/expert.v1.PreparationService/GetCapacity",
    "/expert.v1.PreparationService/Heartbeat",
)
_WARNING_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def server_interceptors(
    service: str, error_mapper: ErrorMapper | None = None, auth: grpc.aio.ServerInterceptor | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors for `grpc.aio.server(interceptors=...)`, outermost first; `auth` (the
    credentials check, None with auth off) goes innermost."""
    interceptors = [LoggingInterceptor(), MetricsInterceptor(service), ErrorInterceptor(error_mapper)]
    return [*interceptors, auth] if auth is not None else interceptors


def status_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status an RPC ended with, given the exception (if any) that left the servicer."""
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        # The server cancels the handler both when the client cancels and when its deadline passes.
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    if isinstance(error, ServiceError):
        return error.code
    # Set by context.abort() (AbortError) or by context.set_code() in the servicer.
    code = context.code()
    if isinstance(code, grpc.StatusCode) and (error is None or code is not grpc.StatusCode.OK):
        return code
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


class ScopedInterceptor(grpc.aio.ServerInterceptor):
    """Runs every servicer method inside `self.scope(handler_call_details, context)`, which each
    interceptor defines."""

    @abc.abstractmethod
    def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext
    ) -> contextlib.AbstractAsyncContextManager[None]: ...

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            # An unknown method: gRPC answers UNIMPLEMENTED itself.
            return None
        return wrap_handler(handler, functools.partial(self.scope, handler_call_details))


def wrap_handler(handler: grpc.RpcMethodHandler, scope: Scope) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour run inside `scope(context)`, whichever of the four kinds it is."""
    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, scope), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_wrap_streaming(handler.unary_stream, scope), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, scope), **codecs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_wrap_streaming(handler.stream_stream, scope), **codecs)
    return handler


def _wrap_unary(behavior: Callable[..., Any], scope: Scope) -> Callable[..., Any]:
    # `request` is a message, or the request iterator of a stream-unary call. A plain function
    # (the generated UNIMPLEMENTED defaults) is called on the event loop: the services are aio.
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with scope(context):
            response = behavior(request, context)
            if inspect.isawaitable(response):
                response = await response
            return response

    return handle


def _wrap_streaming(behavior: Callable[..., Any], scope: Scope) -> Callable[..., Any]:
    # grpc.aio tells the two styles of streaming servicer apart by their type, so the wrapper must
    # keep the style: a coroutine writes with context.write(), a generator yields.
    if inspect.iscoroutinefunction(behavior):

        async def write(request: Any, context: grpc.aio.ServicerContext) -> None:
            async with scope(context):
                await behavior(request, context)

        return write

    async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with scope(context):
            responses = behavior(request, context)
            if hasattr(responses, "__aiter__"):
                # Closed together with this wrapper, the servicer's generator runs its `finally`
                # blocks (freeing an engine request, say) at once, not whenever it is collected.
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
            else:
                for response in responses:
                    yield response

    return generate


def _metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for name, value in details.invocation_metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


class LoggingInterceptor(ScopedInterceptor):
    """Logs one line per RPC (method, status code, duration, peer) and binds `request_id` from the
    `x-request-id` metadata to every line logged while the RPC runs."""

    @contextlib.asynccontextmanager
    async def scope(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        # Read now: grpc core frees the peer string with the transport, so context.peer() on a
        # call the client already cancelled reads freed memory (a segfault; grpc/grpc#29069).
        peer = context.peer()
        error: BaseException | None = None
        with bind_context(request_id=_metadata_value(details, REQUEST_ID_KEY)):
            try:
                yield
            except BaseException as exc:
                error = exc
                raise
            finally:
                code = status_code(context, error)
                if code in _ERROR_CODES:
                    log = _log.error
                elif code in _WARNING_CODES:
                    log = _log.warning
                elif details.method.startswith(_QUIET_PREFIXES):
                    log = _log.debug
                else:
                    log = _log.info
                log(
                    "rpc",
                    method=details.method,
                    code=code.name,
                    duration_ms=round((time.perf_counter() - start) * 1000, 2),
                    peer=peer,
                )
                # The exception's traceback holds this frame, which holds the exception: a cycle that
                # only the cyclic GC frees, and with it the request (up to 64 MB) the servicer's
                # frames hold. Dropping the reference lets reference counting free them at once.
                error = None


class MetricsInterceptor(ScopedInterceptor):
    """Counts RPCs by method and status code and observes their latency (see `libs.metrics`)."""

    def __init__(self, service: str) -> None:
        self._metrics = rpc_metrics(service)

    @contextlib.asynccontextmanager
    async def scope(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            method = details.method.lstrip("/")
            self._metrics.observe(method, status_code(context, error).name, time.perf_counter() - start)
            error = None  # see LoggingInterceptor: no exception-frame cycle keeps the request alive


class ErrorInterceptor(ScopedInterceptor):
    """Turns exceptions into statuses: a `ServiceError` becomes its status with details; any other
    exception is offered to `error_mapper` and otherwise becomes INTERNAL with a generic message
    (logged with its traceback). `context.abort()` by the servicer and cancellation pass through."""

    def __init__(self, error_mapper: ErrorMapper | None = None) -> None:
        self._error_mapper = error_mapper

    @contextlib.asynccontextmanager
    async def scope(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext):
        try:
            yield
        except grpc.aio.AbortError:
            # The servicer called context.abort(): the status is already on its way.
            raise
        except ServiceError as error:
            await context.abort_with_status(to_status(error))
        except Exception as error:
            mapped = self._map(error, details.method)
            if mapped is not None:
                await context.abort_with_status(to_status(mapped))
            chosen = context.code()
            if isinstance(chosen, grpc.StatusCode) and chosen is not grpc.StatusCode.OK:
                # The servicer set a status before raising (the generated UNIMPLEMENTED defaults do).
                await context.abort(chosen, context.details() or chosen.name)
            _log.error("unexpected error", method=details.method, exc_info=error)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)

    def _map(self, error: Exception, method: str) -> ServiceError | None:
        if self._error_mapper is None:
            return None
        try:
            return self._error_mapper(error)
        except Exception:
            _log.exception("error mapper failed", method=method)
            return None
