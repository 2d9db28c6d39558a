"""OpenAI's Responses API (docs/api.md#the-responses-api): `POST /v1/responses`, and
`GET`/`DELETE /v1/responses/{id}` for stored responses. One mechanism with chat completions: a
request becomes a chat-completions request (responses_request.py) that runs through the chat
endpoint's own code (openai.chat_completion), and the completion or its chunks become the
response or its events (responses_output.py, responses_events.py).

`previous_response_id` continues a stored response's conversation: its messages and its answer,
kept with it (response_store.py), come before the new input, and the whole conversation is
answered as a stateless chat would be (the engine's prefix cache reuses the KV it already holds).
No session is created, so responses never count against EXPERT_SESSION_MAX_PER_KEY."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.reception.admission.core import Admission
from services.reception.http.errors import HttpError, ToHttpError, error_response
from services.reception.http.openai import chat_completion
from services.reception.http.response_store import ResponseStore, current_owner
from services.reception.http.responses_events import ResponseEvents
from services.reception.http.responses_output import assistant_message, from_completion, response_shell
from services.reception.http.responses_request import (
    chat_request,
    error_body_in_responses_terms,
    in_responses_terms,
)
from services.reception.http.responses_schema import MAX_RESPONSE_ID_CHARS, ResponsesRequest


def _not_found(response_id: str, param: str | None = None) -> HttpError:
    code = "previous_response_not_found" if param else "not_found"
    return HttpError(404, f"no response {response_id!r} (never stored, expired, or not yours)", param, code)


def add_responses_routes(
    app: FastAPI, admission: Admission, store: ResponseStore | None, to_http_error: ToHttpError
) -> None:
    """The routes over `admission`; without `store` nothing is stored (nor found)."""
    routes = _Responses(admission, store, to_http_error)

    @app.post("/v1/responses")
    async def create_response(request: Request, body: ResponsesRequest):
        try:
            return await routes.create(request, body)
        except HttpError as error:
            return error_response(in_responses_terms(error))
        except Exception as exc:  # Redis unreachable: 503, as elsewhere
            return error_response(to_http_error(exc, body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        try:
            return (await routes.stored(response_id))["response"]
        except HttpError:
            raise
        except Exception as exc:
            return error_response(to_http_error(exc, None))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        try:
            await routes.stored(response_id)
            await store.delete(response_id, current_owner())
        except HttpError:
            raise
        except Exception as exc:
            return error_response(to_http_error(exc, None))
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Responses:
    def __init__(self, admission: Admission, store: ResponseStore | None, to_http_error: ToHttpError) -> None:
        self.admission, self.store, self.to_http_error = admission, store, to_http_error

    async def stored(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The caller's stored response `response_id` (404 naming `param` when there is none)."""
        record = None
        if self.store is not None and len(response_id) <= MAX_RESPONSE_ID_CHARS:
            record = await self.store.get(response_id, current_owner())
        if record is None:
            raise _not_found(response_id, param)
        return record

    async def create(self, request: Request, body: ResponsesRequest):
        """The response to `body`, answered by the chat path; stored when `store` asks for it."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = (await self.stored(body.previous_response_id, "previous_response_id"))["conversation"]
        chat, added = chat_request(body, history)
        answer = await chat_completion(self.admission, request, chat, self.to_http_error)
        if isinstance(answer, JSONResponse):
            return _renamed(answer)
        save = _saver(self.store if body.store else None, [*history, *added], current_owner())
        if isinstance(answer, StreamingResponse):
            events = _events(answer.body_iterator, body, save, self.to_http_error)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        response = from_completion(response_shell(body, answer["expert_system"]["job_id"]), answer)
        await save(response)
        return response


def _saver(store: ResponseStore | None, conversation: list[dict[str, Any]], owner: str):
    """What stores a finished response with its conversation (nothing without a store)."""

    async def save(response: dict[str, Any]) -> None:
        if store is not None:
            await store.put(response, [*conversation, assistant_message(response)], owner)

    return save


def _renamed(answer: JSONResponse) -> JSONResponse:
    """The chat path's error response with its field named as the Responses API names it."""
    if answer.status_code < 400:
        return answer
    body = error_body_in_responses_terms(json.loads(answer.body))
    headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=answer.status_code, headers=headers)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _chunks(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks (its server-sent `data:` lines, up to `[DONE]`)."""
    async for line in lines:
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _events(
    lines: AsyncIterator[str], body: ResponsesRequest, save, to_http_error: ToHttpError
) -> AsyncIterator[str]:
    """The chat stream as the Responses API's events; closed early (the client went away), the
    chat stream is closed, which cancels the job."""
    async with contextlib.aclosing(lines), contextlib.aclosing(_chunks(lines)) as chunks:
        first = await anext(chunks, None)  # the chat stream opens with a chunk naming the job
        if first is None:
            return
        job_id = first.get("id", "").removeprefix("chatcmpl-")
        translator = ResponseEvents(response_shell(body, job_id), job_id)
        for event in translator.opening():
            yield _sse(event)
        async for chunk in _prepend(first, chunks):
            if "error" in chunk:
                for event in translator.failure(error_body_in_responses_terms(chunk)["error"]):
                    yield _sse(event)
                return
            for event in translator.chunk(chunk):
                yield _sse(event)
        events, response = translator.ending()
        try:
            await save(response)
        except Exception as exc:  # Redis unreachable: the client hears it, rather than a lost record
            events = translator.failure(to_http_error(exc, body).body()["error"])
        for event in events:
            yield _sse(event)


async def _prepend(
    first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for item in rest:
        yield item
