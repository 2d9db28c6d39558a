"""The FastAPI app: the probes, the REST API's `/v1/infer` and `/v1/jobs` (rest.py), and OpenAI's
chat, completions and models endpoints over the gRPC servicer's own `infer` / `infer_stream`
(admission, validation, the job record, the queue and the job's event stream); responses and
server-sent events in OpenAI's shapes."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from libs.auth.policy import Authenticator
from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from libs.job_results import failure_code
from services.reception.capacity import Capacity
from services.reception.http.auth import authentication
from services.reception.http.calls import unless_disconnected
from services.reception.http.errors import (
    HTTP_STATUS,
    HttpError,
    as_http_error,
    error_response,
    param_of,
    validation_error,
)
from services.reception.http.models import ServedModels
from services.reception.http.openai_logprobs import chat_logprobs, completion_logprobs
from services.reception.http.openai_request import to_request
from services.reception.http.openai_schema import ChatCompletionRequest, CompletionRequest
from services.reception.http.rest import add_rest_routes
from services.reception.server import ReceptionServicer

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TIMEOUT: "length",  # cut short by timeout_ms: a limit, like max_tokens
    common_pb2.FINISH_REASON_ABORT: "abort",  # cancelled (CancelJob) while it ran
}


def create_app(
    servicer: ReceptionServicer,
    capacity: Capacity,
    models: ServedModels,
    error_mapper: Callable[[BaseException], ServiceError | None] | None = None,
    auth: Authenticator | None = None,
) -> FastAPI:
    app = FastAPI(
        title="Expert System",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # The API key of every /v1 call (the probes need none); nothing is checked without `auth`.
        dependencies=[Depends(authentication(auth, error_mapper))],
    )
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(404)
    async def no_route(request: Request, exc: Exception) -> JSONResponse:
        return error_response(HttpError(404, f"no such endpoint: {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def no_method(request: Request, exc: Exception) -> JSONResponse:
        return error_response(HttpError(405, f"method {request.method} is not allowed on {request.url.path}"))

    to_http_error = functools.partial(as_http_error, error_mapper=error_mapper)
    add_rest_routes(app, servicer, to_http_error)

    @app.get("/livez")
    async def livez() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        engines = (await capacity.get()).engines
        ready = engines > 0
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "engines": engines},
            status_code=200 if ready else 503,
        )

    @app.get("/healthz")
    async def healthz() -> dict:
        engines = (await capacity.get()).engines
        return {"status": "ok" if engines > 0 else "degraded", "engines": engines}

    @app.get("/v1/models")
    async def list_models() -> dict:
        data = [
            {"id": name, "object": "model", "created": started, "owned_by": "expert-system"}
            for name in await models.names()
        ]
        return {"object": "list", "data": data}

    async def complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool):
        inference = to_request(body)
        logprobs = inference.HasField("logprobs")
        if body.stream:
            return await _stream(inference, body, chat)
        try:
            result = await unless_disconnected(request, servicer.infer(inference))
        except Exception as exc:
            return error_response(to_http_error(exc, body))
        if result is None:  # the client hung up, and its job is cancelled
            return JSONResponse({}, status_code=499)  # nobody reads it
        failure = _failure(result, body)
        if failure is not None:
            return error_response(failure)
        return _response(result, body, chat, logprobs)

    async def _stream(inference, body, chat: bool) -> StreamingResponse | JSONResponse:
        messages = servicer.infer_stream(inference)
        try:
            submitted = (await anext(messages)).submitted  # admission: its refusal is the HTTP answer
        except Exception as exc:
            await messages.aclose()
            return error_response(to_http_error(exc, body))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _sse(messages, submitted.job_id, body, chat, include_usage, to_http_error, inference.n or 1)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await complete(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, chat=False)

    return app


def _failure(result: common_pb2.InferenceResult, body) -> HttpError | None:
    """The error for a job that ended without an answer (a refusal was raised before); a later
    stage's refusal names the first field it found wrong (e.g. the engine's `n` above its
    max_num_seqs) as the client sent it."""
    if result.status != common_pb2.JOB_STATUS_FAILED:
        return None
    code = failure_code(result)
    status = HTTP_STATUS.get(code, 500) if code is not None else 500
    param = param_of(result.error_fields[0].field, body) if result.error_fields else None
    name = code.name.lower() if code is not None else "job_failed"
    return HttpError(status, result.error or "the job failed", param, code=name)


def _usage(result: common_pb2.InferenceResult) -> dict[str, int]:
    prompt = result.metrics.input_tokens
    completion = result.metrics.output_tokens or result.tokens_generated
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(reason: int) -> str:
    return _FINISH_REASONS.get(reason, "stop")


def _choices(result: common_pb2.InferenceResult) -> list[common_pb2.Choice]:
    """The result's choices (a result recorded without them, e.g. swept at its deadline: its text)."""
    if result.choices:
        return list(result.choices)
    only = common_pb2.Choice(text=result.text, finish_reason=result.finish_reason)
    only.validation.CopyFrom(result.validation)
    return [only]


def _extra(result: common_pb2.InferenceResult) -> dict[str, Any]:
    """What the Expert System adds to OpenAI's response: the job, the experts it applied and each
    choice's validation (response_format's schema is checked after generation, not enforced)."""
    return {
        "job_id": result.job_id,
        "experts": list(result.experts_used),
        "validation": [
            {
                "index": c.index,
                "valid": c.validation.valid,
                "validator": c.validation.validator,
                "error": c.validation.error,
            }
            for c in _choices(result)
        ],
    }


def _response(result: common_pb2.InferenceResult, body, chat: bool, logprobs: bool) -> dict[str, Any]:
    created = int(result.metrics.submitted_at.seconds) or int(time.time())
    choices = []
    for c in _choices(result):
        choice: dict[str, Any] = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = chat_logprobs(c.logprobs) if logprobs else None
        else:
            choice["text"] = c.text
            choice["logprobs"] = completion_logprobs(c.logprobs) if logprobs else None
        choice["finish_reason"] = _finish_reason(c.finish_reason)
        choices.append(choice)
    kind, prefix = ("chat.completion", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    return {
        "id": prefix + result.job_id,
        "object": kind,
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage(result),
        "expert_system": _extra(result),
    }


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(
    messages, job_id: str, body, chat: bool, include_usage: bool, to_http_error, n: int
) -> AsyncIterator[str]:
    """The job's InferStream messages as OpenAI's server-sent chunks (one choice per chunk, named by
    its index), then each choice's finish chunk and `data: [DONE]`. Closed early (the client went
    away), `messages` is closed, which cancels the job."""
    created = int(time.time())
    kind, prefix = ("chat.completion.chunk", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    offsets = dict.fromkeys(range(n), 0)  # completions' text_offset: each choice's text so far

    def chunk(
        index: int,
        delta: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: list[common_pb2.TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        if chat:
            content: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                content["content"] = delta
            shown = chat_logprobs(logprobs) if logprobs else None
            choice = {"index": index, "delta": content, "logprobs": shown, "finish_reason": finish_reason}
        else:
            shown = completion_logprobs(logprobs, offsets.get(index, 0)) if logprobs else None
            choice = {"index": index, "text": delta or "", "logprobs": shown, "finish_reason": finish_reason}
        data = {
            "id": prefix + job_id,
            "object": kind,
            "created": created,
            "model": body.model,
            "choices": [choice],
        }
        if include_usage:
            data["usage"] = None
        return data

    def error(failure: HttpError) -> str:
        return _event(failure.body())

    async with contextlib.aclosing(messages):
        sent = False
        if chat:
            for index in range(n):
                yield _event(chunk(index, "", role=True))
        try:
            async for message in messages:
                which = message.WhichOneof("event")
                if which == "delta" and (message.delta.text or message.delta.logprobs):
                    sent = True
                    delta = message.delta
                    yield _event(chunk(delta.index, delta.text, logprobs=list(delta.logprobs)))
                    advance = sum(len(t.token) for t in delta.logprobs)
                    offsets[delta.index] = offsets.get(delta.index, 0) + advance
                elif which == "restarted_attempt" and sent:
                    # The job started over on another engine: the text sent cannot be taken back.
                    yield error(HttpError(503, "the job restarted after part of its output was streamed"))
                    return
                elif which == "result":
                    result = message.result
                    failure = _failure(result, body)
                    if failure is not None:
                        yield error(failure)
                        return
                    for c in _choices(result):
                        yield _event(
                            {
                                **chunk(c.index, None if chat else "", _finish_reason(c.finish_reason)),
                                "expert_system": _extra(result),
                            }
                        )
                    if include_usage:
                        yield _event(
                            {
                                "id": prefix + job_id,
                                "object": kind,
                                "created": created,
                                "model": body.model,
                                "choices": [],
                                "usage": _usage(result),
                            }
                        )
                    yield "data: [DONE]\n\n"
                    return
        except Exception as exc:  # a refusal at the end (e.g. an unknown forced expert)
            yield error(to_http_error(exc, body))
