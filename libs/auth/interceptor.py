"""The gRPC server interceptor that enforces `policy` on every call (libs.grpc_server adds it inside
logging, metrics and error mapping, so refusals are logged, counted and sent as statuses)."""

from __future__ import annotations

import contextlib

import grpc

from libs.auth.metadata import AUTHORIZATION_KEY, INTERNAL_TOKEN_KEY, metadata_value
from libs.auth.policy import Authenticator, bearer_token, calling_as
from libs.grpc_interceptors import ScopedInterceptor


class AuthInterceptor(ScopedInterceptor):
    """Refuses a call its credentials do not allow (UNAUTHENTICATED, PERMISSION_DENIED), and makes
    the caller it proves the current caller (`policy.current_caller`) while the servicer runs."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._authenticator = authenticator

    @contextlib.asynccontextmanager
    async def scope(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext):
        metadata = details.invocation_metadata
        caller = await self._authenticator.authenticate(
            self._authenticator.access_of(details.method),
            bearer_token(metadata_value(metadata, AUTHORIZATION_KEY)),
            metadata_value(metadata, INTERNAL_TOKEN_KEY),
        )
        with calling_as(caller):
            yield
