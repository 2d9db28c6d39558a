"""The one check of the text in a JSON body: a dependency of every route that reads one (chat,
completions, Responses, the REST API), run after the body parsed and before anything reads a field
of it. It walks the parsed body whole (every string and every key, whatever the route's schema
makes of it: typed fields, free-form tool definitions and calls, Responses items, JSON schemas), so
no field is left out by construction and no field needs a check of its own. Text UTF-8 cannot hold
(a lone surrogate, which JSON may escape) is refused, 400 naming the field as the client wrote it
(`messages[0].tool_calls[0].function.arguments`), before a protobuf, the engine's tokenizer or any
other stage could fail on it. Text escaped a second time inside a JSON text (a call's `arguments`,
a schema given as text) is checked where that text is parsed: reception's validation
(admission/tools.py, admission/validation.py)."""

from __future__ import annotations

from fastapi import Depends, Request

from libs.utf8 import undecodable
from services.reception.http.errors import HttpError


async def refuse_undecodable_text(request: Request) -> None:
    """Raise a 400 naming the first string (or key) of the body that UTF-8 cannot hold."""
    try:
        # FastAPI parsed the body before its dependencies run, and Starlette keeps that parse: this
        # is the same object, not a second parse. A body that is not JSON FastAPI refuses itself.
        body = await request.json()
    except ValueError:
        return
    # BodyGuard bounded the body's nesting before any parser; the walk is iterative all the same.
    found = undecodable(body, "")
    if found is not None:
        path, problem = found
        raise HttpError(400, f"{path or 'body'}: {problem}", path or None, "invalid_value")


# What a route lists in its `dependencies` (after the app's own: the API key is checked first).
TEXT_ONLY = Depends(refuse_undecodable_text)
