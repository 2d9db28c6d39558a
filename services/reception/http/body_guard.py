"""The first thing every HTTP request meets, before authentication and before any parser: its body is
read into memory only up to `max_bytes` (413 as soon as one byte more is declared or arrives, with
or without a Content-Length), a JSON body nested deeper than MAX_JSON_DEPTH is refused (400)
before a recursive parser sees it, and a body that is not JSON by its Content-Type is refused (415,
media_type.py). The app then reads the body from what was kept.

An ASGI middleware rather than a FastAPI dependency: FastAPI reads and parses the whole body before
any dependency runs, the API key check included. Nor FastAPI's `max_body_size` (Starlette's
RequestBodyLimitMiddleware): it counts only as a route reads, answers in plain text, and bounds no
nesting, which must be checked on the bytes since Python's JSON parser recurses.

An upload route (`UploadRoute`: POST /v1/files, a multipart form) is the exception: its body is
neither kept nor JSON, so it is passed on as it arrives, counted, and refused (413, the route's
setting named) once its Content-Length or its bytes pass the route's own bound; the route then
reads it after the API key check."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from services.reception.http.errors import HttpError, error_response
from services.reception.http.media_type import media_type_error

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# EXPERT_HTTP_MAX_BODY_BYTES's default: a request at every input limit (500,000 characters of input,
# docs/design.md#input-limits) fits, even with its text escaped as JSON's \uXXXX.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

# Objects and arrays inside each other: a request needs a handful of levels, plus a response format's
# schema (itself at most 64 levels: docs/design.md#input-limits) inside `response_format.json_schema`.
MAX_JSON_DEPTH = 128

# A JSON string once its escaped backslashes and quotes are cut out: brackets inside strings are text.
_STRING = re.compile(rb'"[^"]*"')
# Every bracket as `[` or `]`, everything else dropped.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


@dataclass(frozen=True)
class UploadRoute:
    """A route whose POST body is an upload: streamed to the route, bounded by its own setting."""

    max_bytes: int  # the whole body: the file's cap and room for the form's other parts
    setting: str  # what sets the bound, named in the refusal


class BodyGuard:
    """ASGI middleware over `app`: HTTP bodies bounded to `max_bytes` and MAX_JSON_DEPTH, but the
    POST bodies of `uploads` (by path), bounded by theirs."""

    def __init__(
        self,
        app: App,
        max_bytes: int,
        on_refused: Callable[[HttpError], None] = lambda _: None,
        uploads: Mapping[str, UploadRoute] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused
        self.uploads = dict(uploads or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = self.uploads.get(scope["path"]) if scope["method"] == "POST" else None
        if upload is not None:
            await self._upload(upload, scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, receive, send, declared)
            return
        body = await self._read(receive)
        if body is None:  # the client hung up while sending
            return
        if isinstance(body, int):
            await self._too_large(scope, receive, send, body)
            return
        if nested_deeper_than(body, MAX_JSON_DEPTH):
            message = f"the body is nested deeper than {MAX_JSON_DEPTH} levels (objects and arrays)"
            await self._refuse(HttpError(400, message, None, "invalid_json"), scope, receive, send)
            return
        not_json = media_type_error(scope, body)
        if not_json is not None:
            await self._refuse(not_json, scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The whole body; the count of bytes received once it passes `max_bytes` (the rest is not
        read); None when the client disconnected."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _upload(self, upload: UploadRoute, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > upload.max_bytes:
            error = too_large(upload.max_bytes, upload.setting, declared)
            await self._refuse(error, scope, receive, send)
            return
        await self.app(scope, _counted(receive, upload), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        error = too_large(self.max_bytes, "EXPERT_HTTP_MAX_BODY_BYTES", size)
        await self._refuse(error, scope, receive, send)

    async def _refuse(self, error: HttpError, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refused(error)
        await error_response(error)(scope, receive, send)


def too_large(limit: int, setting: str, size: int) -> HttpError:
    """The 413 for a body of `size` bytes or more over `limit`; the connection is closed after the
    answer, so the rest of the body is never read."""
    return HttpError(
        413,
        f"the request body is larger than the limit of {limit} bytes ({setting}): {size} bytes or more",
        None,
        "request_too_large",
        headers={"Connection": "close"},
    )


def _counted(receive: Receive, upload: UploadRoute) -> Receive:
    """The app's `receive` for an upload: the client's messages as they come, raising the 413 (the
    route answers it as any HttpError) at the first byte over the route's bound."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > upload.max_bytes:
            raise too_large(upload.max_bytes, upload.setting, received)
        return message

    return counted


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before the app sees the request
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's `receive`: the body kept, as one message, then the client's own messages (its
    disconnect, which a waiting call watches for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def nested_deeper_than(body: bytes, limit: int) -> bool:
    """Whether the objects and arrays of JSON text `body` nest deeper than `limit`. Without parsing,
    in passes of C-speed byte operations: strings are cut out, then each pass removes the innermost
    pairs (one level everywhere), until the openings left cannot nest past the limit, or a run of
    them shows that they do."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped).translate(_BRACKETS, _NOT_BRACKETS)
    for removed in range(limit + 1):  # `removed` levels are gone from every nest
        left = limit - removed  # how deep what is left may still nest
        if brackets.count(b"[") <= left:
            return False
        if b"[" * (left + 1) in brackets:  # a run of openings, each inside the one before
            return True
        innermost_gone = brackets.replace(b"[]", b"")
        if len(innermost_gone) == len(brackets):  # no pair left: not JSON, which its parser says
            return False
        brackets = innermost_gone
    return True
