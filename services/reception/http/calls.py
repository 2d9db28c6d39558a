"""A non-streamed call that ends when its client hangs up: Starlette tells a handler nothing of a
disconnect until it reads the request again, so the call races the next `http.disconnect`.
`infer` is that call for the OpenAI routes and REST alike.

It also races the end of the HTTP server's grace when reception stops (`cut_off`, set by
server.py a margin before uvicorn cancels what still runs, which a call would answer with a
plain-text 500): a call still waiting then is answered at once, with its job's id when it has one,
as the drain's hand-back answers it (admission/core.py, JobHandedBack)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from services.reception.admission.core import AWAITED_JOB, HANDED_BACK_RETRY_S, JobHandedBack, Submitted
from services.reception.http.errors import ToHttpError, error_response
from services.reception.job_events import JobEvent

T = TypeVar("T")


class JobRunner(Protocol):
    """What admits and follows a job for a route: `Admission` itself, or a front's own runner
    over it (the Responses API's session turns, response_sessions.py)."""

    async def infer(self, request: common_pb2.InferenceRequest) -> common_pb2.InferenceResult: ...

    def stream(self, request: common_pb2.InferenceRequest) -> AsyncIterator[Submitted | JobEvent]: ...


def cut_off(app: FastAPI) -> asyncio.Event:
    """The event the HTTP server sets when its grace is about to end (server.py)."""
    if not hasattr(app.state, "cut_off"):
        app.state.cut_off = asyncio.Event()
    return app.state.cut_off


async def unless_disconnected(request: Request, call: Coroutine[Any, Any, T]) -> T | None:
    """`call`'s result, or None when the client hung up first: the call is then cancelled, which
    cancels its job (Admission.infer). The call's own exception is raised; so is JobHandedBack (or
    UNAVAILABLE before a job was admitted) when the server's grace ends first."""
    # The call runs in a context of its own, where Admission.result sets the job it awaits.
    context = contextvars.copy_context()
    work = asyncio.get_running_loop().create_task(call, context=context)
    gone = asyncio.ensure_future(_disconnected(request))
    stopped = asyncio.ensure_future(cut_off(request.app).wait())
    handed_back = None
    try:
        await asyncio.wait({work, gone, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done() and not work.done():
            handed_back = _handed_back(context)  # read before the cancel resets the awaited job
    finally:
        gone.cancel()
        stopped.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
    try:
        if handed_back is not None:
            raise handed_back
        return None if work.cancelled() else work.result()
    finally:
        # The call's exception holds this frame (its traceback) and the future holds the exception:
        # dropped here, a refused request (its body, its copies) is freed at once, not by the
        # cyclic GC some time later.
        del work, gone, stopped, handed_back


def _handed_back(context: contextvars.Context) -> ServiceError:
    """What a call cut off by the stop raises: its job carries on (the one Admission.result awaits in
    the call's context), or, before its admission, send it again."""
    job_id = context.get(AWAITED_JOB)
    if job_id is not None:
        return JobHandedBack(job_id)
    message = "this reception is stopping before the request was admitted: send it again"
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=HANDED_BACK_RETRY_S)


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
