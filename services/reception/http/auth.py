"""The HTTP front's credentials check: `Authorization: Bearer <key>` on every /v1 route (the probes
/livez, /readyz and /healthz need none), decided by the same `Authenticator` as the gRPC API, so a
key means the same on both. A refusal is OpenAI's error body: 401 with code "invalid_api_key" for
a missing, wrong or revoked key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

from libs.auth.metadata import INTERNAL_TOKEN_KEY
from libs.auth.policy import Access, Authenticator, bearer_token, serving_as
from libs.errors import ServiceError
from libs.logging import get_logger
from services.reception.http.errors import HttpError, from_service_error

log = get_logger(__name__)

API_PREFIX = "/v1/"


def authentication(
    auth: Authenticator | None,
    error_mapper: Callable[[BaseException], ServiceError | None] | None = None,
) -> Callable[[Request], Awaitable[None]]:
    """The app-wide dependency that checks a request's credentials and makes the caller they prove
    the current caller of the request (its admission then applies the key's limits). A failure to
    check (Redis down) is answered as `error_mapper` maps it (503), never as a traceback."""

    async def authenticate(request: Request) -> None:
        if auth is None or not request.url.path.startswith(API_PREFIX):
            return
        try:
            caller = await auth.authenticate(
                Access.INFER,
                bearer_token(request.headers.get("authorization")),
                request.headers.get(INTERNAL_TOKEN_KEY),
            )
        except ServiceError as error:
            raise from_service_error(error, None) from None
        except Exception as error:
            mapped = error_mapper(error) if error_mapper is not None else None
            if mapped is not None:
                raise from_service_error(mapped, None) from None
            log.exception("checking an HTTP request's credentials failed", exc_info=error)
            raise HttpError(500, "internal error", code="internal") from None
        serving_as(caller)

    return authenticate
