"""The answer of a JSON route whose call either returns its body or raises: the body with the
route's status, or OpenAI's error body for what the call raised (a ServiceError as its status,
anything else a logged 500; errors.as_http_error). The training and fine-tuning routes answer
every call this way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from services.reception.http.errors import ToHttpError, error_response


def _unchanged(error: Exception) -> BaseException:
    return error


async def json_answer(
    call: Callable[[], Awaitable[Any]],
    to_http_error: ToHttpError,
    status: int = 200,
    restate: Callable[[Exception], BaseException] = _unchanged,
) -> JSONResponse:
    """`await call()` as JSON with `status`, or the error body of what it raised, first passed
    through `restate` (a route that names fields as its clients do renames them there). A
    cancellation is not an answer: it propagates."""
    try:
        return JSONResponse(await call(), status_code=status)
    except Exception as exc:
        return error_response(to_http_error(restate(exc), None))
