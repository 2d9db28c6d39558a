"""Registering a gRPC servicer whose requests may not parse: protobuf refuses a string field that
is not UTF-8 before any handler runs, which grpc answers with INTERNAL. Here the deserializer hands
the handler an `Undecodable` instead, and the handler refuses it as INVALID_ARGUMENT naming the
field, as it does any other bad input."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import grpc
from google.protobuf.message import DecodeError

from services.reception.admission.core import Undecodable


def tolerant(message: type) -> object:
    """A request deserializer that turns a parse failure into an Undecodable."""

    def deserialize(data: bytes) -> object:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


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
