"""Registering a gRPC servicer whose requests may not parse: protobuf refuses a string field that
is not UTF-8 before any handler runs, which grpc answers with INTERNAL. Here the deserializer hands
the handler an `Undecodable` instead, and the handler refuses it as INVALID_ARGUMENT naming the
field, as it does any other bad input (`parsed`), or, for a service whose every method is unary and
has nothing to apply before (`add_refusing_service`), it is refused before the handler runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from types import ModuleType
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError

from libs.errors import invalid_argument
from services.reception.admission.core import Undecodable

Request = TypeVar("Request")


def tolerant(message: type) -> object:
    """A request deserializer that turns a parse failure into an Undecodable."""

    def deserialize(data: bytes) -> object:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


def parsed(request: Request | Undecodable) -> Request:
    """`request`, unless it did not parse: then INVALID_ARGUMENT naming the request."""
    if isinstance(request, Undecodable):
        reason = f"not a valid request message ({request.reason}); text must be UTF-8"
        raise invalid_argument("request", reason)
    return request


def add_tolerant_service(
    server: grpc.aio.Server,
    service: str,
    servicer: object,
    methods: Iterable[str],
    messages: ModuleType,
    streaming: Iterable[str] = (),
) -> str:
    """Register `servicer`'s `methods` as `service`, each taking `<name>Request` and answering
    `<name>Response` from the `messages` module (a server stream for the names in `streaming`)."""
    streaming = set(streaming)
    handlers = {}
    for name in methods:
        kind = (
            grpc.unary_stream_rpc_method_handler if name in streaming else grpc.unary_unary_rpc_method_handler
        )
        request, response = getattr(messages, f"{name}Request"), getattr(messages, f"{name}Response")
        handlers[name] = kind(getattr(servicer, name), tolerant(request), response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    return service


def add_refusing_service(
    server: grpc.aio.Server, service: str, servicer: object, methods: Iterable[str], messages: ModuleType
) -> str:
    """`add_tolerant_service` for unary `methods` that never see an Undecodable: a request that did
    not parse is refused (`parsed`) before the servicer's method runs."""
    refusing = _Refusing({name: _refusing(getattr(servicer, name)) for name in methods})
    return add_tolerant_service(server, service, refusing, methods, messages)


class _Refusing:
    def __init__(self, handlers: dict[str, Callable[..., Awaitable[object]]]) -> None:
        self.__dict__.update(handlers)


def _refusing(method: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
    async def handle(request: object, context: grpc.aio.ServicerContext) -> object:
        return await method(parsed(request), context)

    return handle
