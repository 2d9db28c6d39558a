"""The media type of a request body: every body the HTTP front reads is JSON, so a body sent with
another Content-Type (a form, plain text) or none is refused with 415 and a message that says what
to send, rather than read as bytes and refused for its shape (FastAPI reads JSON only under a JSON
Content-Type). An empty body needs none (a cancel's POST)."""

from __future__ import annotations

from collections.abc import MutableMapping
from email.message import Message
from typing import Any

from services.reception.http.errors import HttpError


def is_json(content_type: str) -> bool:
    """Whether a Content-Type value names JSON: application/json or application/<x>+json."""
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def media_type_error(scope: MutableMapping[str, Any], body: bytes) -> HttpError | None:
    """The 415 for a non-empty body whose Content-Type is not JSON; None when the body may be read."""
    if not body:
        return None
    content_type = next((v for n, v in scope.get("headers", ()) if n == b"content-type"), None)
    text = content_type.decode("latin-1") if content_type is not None else None
    if text is not None and is_json(text):
        return None
    sent = f"not {text!r}" if text is not None else "the request has no Content-Type"
    return HttpError(
        415,
        f"the body must be JSON sent with 'Content-Type: application/json' ({sent})",
        None,
        "unsupported_media_type",
    )
