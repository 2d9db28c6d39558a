"""The HTTP front's credentials check: `Authorization: Bearer <key>` on every /v1 route (the probes
/livez, /readyz, /healthz and /health need none), decided by the same `Authenticator` as the gRPC API, so a
key means the same on both. Every /v1 route needs a key of any scope (INFER) but those ROUTE_ACCESS
names. A refusal is OpenAI's error body: 401 with code "invalid_api_key" for a missing, wrong or
revoked key, 403 for a key whose scope the route does not admit."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

from libs.auth.metadata import INTERNAL_TOKEN_KEY
from libs.auth.policy import Access, Authenticator, bearer_token, serving_as
from libs.errors import ServiceError
from services.reception.http.errors import as_http_error

API_PREFIX = "/v1/"

# The /v1 routes that need more than an inference key, by path (the path itself and all below it)
# and method (None: every method).
ROUTE_ACCESS: tuple[tuple[str, frozenset[str] | None, Access], ...] = (
    ("/v1/files", None, Access.TRAIN),  # training files: uploading, listing, reading and deleting them
    # Changing a training job (create, cancel, checkpoint, resume); reading one's own needs any key.
    ("/v1/training/jobs", frozenset({"POST", "DELETE"}), Access.TRAIN),
    # OpenAI's fine-tuning API over the same jobs: creating and cancelling one (both POST).
    ("/v1/fine_tuning/jobs", frozenset({"POST"}), Access.TRAIN),
)


def access_of(path: str, method: str = "GET") -> Access:
    """What a `method` call of the /v1 route at `path` needs."""
    for prefix, methods, access in ROUTE_ACCESS:
        if (path == prefix or path.startswith(prefix + "/")) and (methods is None or method in methods):
            return access
    return Access.INFER


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
                access_of(request.url.path, request.method),
                bearer_token(request.headers.get("authorization")),
                request.headers.get(INTERNAL_TOKEN_KEY),
            )
        except Exception as error:
            raise as_http_error(error, None, error_mapper) from None
        serving_as(caller)

    return authenticate
