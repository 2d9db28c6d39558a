"""OpenAI's Responses API (docs/api.md#the-responses-api): `POST /v1/responses`, and
`GET`/`DELETE /v1/responses/{id}` for stored responses. One mechanism with chat completions: a
request becomes a chat-completions request (responses_request.py) that runs through the chat
endpoint's own code (openai.chat_completion), and the completion or its chunks become the
response or its events (responses_output.py, responses_events.py).

A stored response (`store`, the default) runs as a turn of a session (response_sessions.py): a
request without `previous_response_id` opens one, a continuation of a chain's latest response is
its session's next turn, anything else a new session seeded with the conversation. The stored
record (response_store.py) keeps the conversation too, so a response outlives its session: once
the session is gone its continuation opens a new one from that conversation. `store: false` runs
a plain job and keeps nothing."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.reception.admission.core import Admission
from services.reception.admission.sessions import SessionAdmission
from services.reception.http.errors import HttpError, ToHttpError, error_response
from services.reception.http.openai import chat_completion
from services.reception.http.response_sessions import ChainLink, SessionResponder, http_peer
from services.reception.http.response_store import ResponseStore, current_owner
from services.reception.http.responses_events import ResponseEvents
from services.reception.http.responses_output import assistant_message, from_completion, response_shell
from services.reception.http.responses_request import (
    chat_request,
    error_body_in_responses_terms,
    in_responses_terms,
)
from services.reception.http.responses_schema import MAX_RESPONSE_ID_CHARS, ResponsesRequest
from services.reception.http.text_guard import TEXT_ONLY


def _not_found(response_id: str, param: str | None = None) -> HttpError:
    code = "previous_response_not_found" if param else "not_found"
    return HttpError(404, f"no response {response_id!r} (never stored, expired, or not yours)", param, code)


def add_responses_routes(
    app: FastAPI,
    admission: Admission,
    store: ResponseStore | None,
    to_http_error: ToHttpError,
    sessions: SessionAdmission | None = None,
) -> None:
    """The routes over `admission`; without `store` nothing is stored (nor found), without
    `sessions` stored responses run as plain jobs."""
    routes = _Responses(admission, store, to_http_error, sessions)

    @app.post("/v1/responses", dependencies=[TEXT_ONLY])
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
    def __init__(
        self,
        admission: Admission,
        store: ResponseStore | None,
        to_http_error: ToHttpError,
        sessions: SessionAdmission | None,
    ) -> None:
        self.admission, self.store, self.to_http_error = admission, store, to_http_error
        self.sessions = sessions

    async def stored(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The caller's stored response `response_id` (404 naming `param` when there is none)."""
        record = None
        if self.store is not None and len(response_id) <= MAX_RESPONSE_ID_CHARS:
            record = await self.store.get(response_id, current_owner())
        if record is None:
            raise _not_found(response_id, param)
        return record

    async def create(self, request: Request, body: ResponsesRequest):
        """The response to `body`, answered by the chat path (as a session's turn when stored);
        stored when `store` asks for it."""
        previous = None
        if body.previous_response_id is not None:
            previous = await self.stored(body.previous_response_id, "previous_response_id")
        history = previous["conversation"] if previous is not None else []
        chat, added = chat_request(body, history)
        runner = self._runner(request, body, previous, len(added))
        answer = await chat_completion(runner, request, chat, self.to_http_error)
        if isinstance(answer, JSONResponse):
            return _renamed(answer)
        save = _saver(self.store if body.store else None, [*history, *added], current_owner(), runner)

        def shell(job_id: str) -> dict[str, Any]:
            return _linked(response_shell(body, job_id), runner)

        if isinstance(answer, StreamingResponse):
            events = _events(answer.body_iterator, shell, save, self.to_http_error, body)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        response = from_completion(shell(answer["expert_system"]["job_id"]), answer)
        await save(response)
        return response

    def _runner(
        self, request: Request, body: ResponsesRequest, previous: dict[str, Any] | None, added: int
    ) -> Admission | SessionResponder:
        """What runs the chat job: a session's turn for a stored response (continuing the previous
        response's session if the instructions and model are the same), else a plain job."""
        if not body.store or self.store is None or self.sessions is None:
            return self.admission
        follows = None
        if previous is not None and all(
            previous["response"][name] == getattr(body, name) for name in ("instructions", "model")
        ):
            follows = ChainLink.of(previous)
        return SessionResponder(self.sessions, http_peer(request), added, follows)


def _linked(shell: dict[str, Any], runner: Admission | SessionResponder) -> dict[str, Any]:
    """The response's shell naming its session and turn, when a session's turn answers it."""
    link = getattr(runner, "link", None)
    if link is not None:
        shell["expert_system"] = link.as_json()
    return shell


def _saver(
    store: ResponseStore | None,
    conversation: list[dict[str, Any]],
    owner: str,
    runner: Admission | SessionResponder,
):
    """What stores a finished response with its conversation and its session's link (nothing
    without a store)."""

    async def save(response: dict[str, Any]) -> None:
        if store is None:
            return
        link = getattr(runner, "link", None)
        if link is None and "session_id" in response.get("expert_system", {}):
            # A stream named the session it began in, whose turn a plain job then answered.
            response["expert_system"] = {
                k: v for k, v in response["expert_system"].items() if k not in ("session_id", "session_turn")
            }
        await store.put(response, [*conversation, assistant_message(response)], owner, link)

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
    lines: AsyncIterator[str], shell, save, to_http_error: ToHttpError, body: ResponsesRequest
) -> AsyncIterator[str]:
    """The chat stream as the Responses API's events; closed early (the client went away), the
    chat stream is closed, which cancels the job."""
    async with contextlib.aclosing(lines), contextlib.aclosing(_chunks(lines)) as chunks:
        first = await anext(chunks, None)  # the chat stream opens with a chunk naming the job
        if first is None:
            return
        job_id = first.get("id", "").removeprefix("chatcmpl-")
        translator = ResponseEvents(shell(job_id), job_id)
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
