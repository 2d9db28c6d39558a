"""Credentials as call metadata: `authorization: Bearer <key>` for an API key, and the internal
token in its own key, which every service-to-service channel sends (`internal_token_interceptors`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

AUTHORIZATION_KEY = "authorization"
INTERNAL_TOKEN_KEY = "x-expert-internal-token"


def credentials_metadata(
    api_key: str | None = None, internal_token: str | None = None
) -> list[tuple[str, str]]:
    """The metadata that carries `api_key` and/or `internal_token` (none for empty values)."""
    metadata = []
    if api_key:
        metadata.append((AUTHORIZATION_KEY, f"Bearer {api_key}"))
    if internal_token:
        metadata.append((INTERNAL_TOKEN_KEY, internal_token))
    return metadata


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str | None:
    """The first value of `key` in received metadata, as text."""
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


class _WithToken:
    """Adds the internal token to the metadata of each call it intercepts."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the internal token must not be empty")
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(INTERNAL_TOKEN_KEY, self._token)
        return details._replace(metadata=metadata)


class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def internal_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors that send `token` on every call of an aio channel, one per kind of RPC: a
    channel files each interceptor under the first kind it implements only."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
