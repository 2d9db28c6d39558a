"""A non-streamed call that ends when its client hangs up: Starlette tells a handler nothing of a
disconnect until it reads the request again, so the call races the next `http.disconnect`.
`infer` is that call for the OpenAI routes and REST alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from libs.gen.expert.v1 import common_pb2
from services.reception.admission.core import Submitted
from services.reception.http.errors import ToHttpError, error_response
from services.reception.job_events import JobEvent

T = TypeVar("T")


class JobRunner(Protocol):
    """What admits and follows a job for a route: `Admission` itself, or a front's own runner
    over it (the Responses API's session turns, response_sessions.py)."""

    async def infer(self, request: common_pb2.InferenceRequest) -> common_pb2.InferenceResult: ...

    def stream(self, request: common_pb2.InferenceRequest) -> AsyncIterator[Submitted | JobEvent]: ...


async def unless_disconnected(request: Request, call: Awaitable[T]) -> T | None:
    """`call`'s result, or None when the client hung up first: the call is then cancelled, which
    cancels its job (Admission.infer). The call's own exception is raised."""
    work = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
    try:
        return None if work.cancelled() else work.result()
    finally:
        # The call's exception holds this frame (its traceback) and the future holds the exception:
        # dropped here, a refused request (its body, its copies) is freed at once, not by the
        # cyclic GC some time later.
        del work, gone


async def infer(
    admission: JobRunner,
    request: Request,
    inference: common_pb2.InferenceRequest,
    body: object,
    to_http_error: ToHttpError,
) -> common_pb2.InferenceResult | JSONResponse:
    """The job's result, or the response to send instead: the refusal as the route's error body,
    or nothing for a client that hung up (its job is cancelled)."""
    try:
        result = await unless_disconnected(request, admission.infer(inference))
    except Exception as exc:
        return error_response(to_http_error(exc, body))
    if result is None:
        return JSONResponse({}, status_code=499)  # nobody reads it
    return result


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
