"""OpenAI's chat and completions endpoints, an adapter over the admission core: the body becomes an
InferenceRequest (openai_request.py), admitted and followed by `Admission.infer` / `.stream`, and
the result or the job's events become OpenAI's response or server-sent chunks
(openai_response.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from libs.gen.expert.v1 import common_pb2
from services.reception.admission.core import Admission, Submitted
from services.reception.http.calls import JobRunner, infer
from services.reception.http.completion_prompts import complete_prompts, per_prompt
from services.reception.http.completion_streams import stream_prompts
from services.reception.http.errors import HttpError, ToHttpError, error_response
from services.reception.http.ignored_fields import report_ignored
from services.reception.http.openai_request import to_request
from services.reception.http.openai_response import Chunks, event, failure, response
from services.reception.http.openai_schema import ChatCompletionRequest, CompletionRequest
from services.reception.http.text_guard import TEXT_ONLY
from services.reception.job_events import Delta, Finished, JobEvent, Restarted
from services.reception.metrics import ReceptionMetrics


def add_openai_routes(
    app: FastAPI, admission: Admission, to_http_error: ToHttpError, metrics: ReceptionMetrics | None = None
) -> None:
    """The two endpoints; the ignored fields a request carries are logged, counted in `metrics` and
    named in the answer's header (ignored_fields.py), whatever the answer."""

    @app.post("/v1/chat/completions", dependencies=[TEXT_ONLY])
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        answer = await _complete(admission, request, body, True, to_http_error)
        return _with_headers(answer, report_ignored(body, metrics))

    @app.post("/v1/completions", dependencies=[TEXT_ONLY])
    async def completions(request: Request, body: CompletionRequest):
        answer = await _complete(admission, request, body, False, to_http_error)
        return _with_headers(answer, report_ignored(body, metrics))


def _with_headers(answer: Response | dict, headers: dict[str, str]) -> Response | dict:
    if not headers:
        return answer
    if isinstance(answer, Response):
        answer.headers.update(headers)
        return answer
    return JSONResponse(answer, headers=headers)


async def _complete(
    admission: JobRunner,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    to_http_error: ToHttpError,
):
    inference = to_request(body)
    several = per_prompt(body, inference) if isinstance(body, CompletionRequest) else None
    if several is not None and body.stream:
        return await stream_prompts(admission, body, several, to_http_error)
    if several is not None:
        return await complete_prompts(admission, request, body, several, to_http_error)
    logprobs = inference.HasField("logprobs")
    if body.stream:
        return await _stream(admission, inference, body, chat, to_http_error)
    result = await infer(admission, request, inference, body, to_http_error)
    if isinstance(result, JSONResponse):
        return result
    failed = failure(result, body)
    if failed is not None:
        return error_response(failed)
    return response(result, body, chat, logprobs)


async def _stream(
    admission: JobRunner,
    inference: common_pb2.InferenceRequest,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    to_http_error: ToHttpError,
) -> StreamingResponse | JSONResponse:
    events = admission.stream(inference)
    try:
        submitted: Submitted = await anext(events)  # admission: its refusal is the HTTP answer
    except Exception as exc:
        await events.aclose()
        return error_response(to_http_error(exc, body))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    calls = bool(inference.tools) and not (
        inference.tool_choice.WhichOneof("choice") == "mode"
        and inference.tool_choice.mode == common_pb2.TOOL_CHOICE_MODE_NONE
    )
    chunks = Chunks(submitted.submission.job_id, body, chat, include_usage, inference.n or 1, calls)
    return StreamingResponse(
        _sse(events, chunks, body, to_http_error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _sse(
    events: AsyncIterator[JobEvent], chunks: Chunks, body, to_http_error: ToHttpError
) -> AsyncIterator[str]:
    """The job's events as OpenAI's server-sent chunks, then each choice's finish chunk and
    `data: [DONE]`; a failure is one error event. Closed early (the client went away), `events` is
    closed, which cancels the job. Chat's opening chunks (the role) go with the first output, as
    vLLM's and OpenAI's do: load generators time the first token by the first chunk."""
    async with contextlib.aclosing(events):
        sent = False
        try:
            async for job_event in events:
                match job_event:
                    case Delta(delta) if delta.text or delta.logprobs or delta.tool_calls:
                        for line in [*([] if sent else chunks.opening()), *chunks.delta(delta)]:
                            sent = True
                            yield line
                    case Restarted() if sent:
                        # The job started over on another engine: the text sent cannot be taken back.
                        yield _error(
                            HttpError(
                                503,
                                "the job restarted after part of its output was streamed",
                                code="job_restarted",
                            )
                        )
                        return
                    case Restarted():
                        pass  # nothing was sent yet: the new attempt's chunks are the answer
                    case Finished(result):
                        failed = failure(result, body)
                        if failed is not None:
                            yield _error(failed)
                            return
                        for line in [*([] if sent else chunks.opening()), *chunks.ending(result)]:
                            yield line
                        return
        except Exception as exc:  # a refusal at the end (e.g. an unknown forced expert)
            yield _error(to_http_error(exc, body))


def _error(error: HttpError) -> str:
    return event(error.body())


async def chat_completion(
    admission: JobRunner, request: Request, body: ChatCompletionRequest, to_http_error: ToHttpError
) -> dict | StreamingResponse | JSONResponse:
    """What `/v1/chat/completions` answers `body`: the completion, its stream, or the error
    response. Other front ends (the Responses API) run their requests through it."""
    return await _complete(admission, request, body, True, to_http_error)
