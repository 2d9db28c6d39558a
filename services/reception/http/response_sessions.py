"""Stored responses of the Responses API as turns of sessions (docs/api.md#the-responses-api): a
chain of responses (each continuing the last by `previous_response_id`) is one session, so its
engine keeps the conversation's KV between them and each response's input is appended as the
session's next turn, through the same session calls as SessionService (admission/sessions.py).

`SessionResponder` runs one response's chat job in place of `Admission`'s infer/stream, which the
chat path calls: as the next turn of the previous response's session when that response is still
its latest turn; otherwise (a branch from an older response, a session that expired or ended,
other instructions or another model) as the first turn of a new session seeded with the whole
conversation; and as a plain job, as a chat completion is, when its owner has no room for another
session (EXPERT_SESSION_MAX_PER_KEY, EXPERT_SESSION_CREATE_PER_MINUTE), or when the engines refuse
the turn for want of room for a session (EXPERT_MAX_SESSIONS).

Tools are a turn's like any other field of the job (its `tools`, `tool_choice`,
`parallel_tool_calls`, docs/api.md#tools-in-a-session): a response's function calls end its turn
(the session keeps them as the reply's `tool_calls`), and the next response's
`function_call_output` items are that session's next input, as `tool` messages. So a tool loop
chained by `previous_response_id` (the OpenAI Agents SDK's `auto_previous_response_id`) is one
session. The Responses API's input has no participant `name`, which a session turn would not render."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
from fastapi import Request

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2, session_pb2
from libs.job_results import failure_code
from libs.logging import get_logger
from services.reception.admission.core import Admitted, Submitted
from services.reception.admission.sessions import SessionAdmission
from services.reception.job_events import Finished, JobEvent
from services.reception.sessions import NotLatest

log = get_logger(__name__)


class ChainLink(NamedTuple):
    """A stored response's place in its session: the session and the turn that answered it."""

    session_id: str
    turn: int

    def as_json(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "session_turn": self.turn}

    @classmethod
    def of(cls, record: dict[str, Any]) -> ChainLink | None:
        """The link a stored response's record holds (None: it was answered as a plain job)."""
        link = record.get("session")
        return cls(link["session_id"], link["session_turn"]) if link else None


def http_peer(request: Request) -> str:
    """The HTTP client's address as gRPC writes a peer, for the per-client session limits with
    auth off (LimitOwner)."""
    client = request.client
    if client is None:
        return ""
    host, port = client.host, client.port
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class SessionResponder:
    """Runs one stored response's chat job as a session's turn (see the module's docstring).
    `added` is how many of the job's messages are the request's own input (the rest is the
    conversation before it); `follows` is the previous response's link, to continue its session.
    Once the job is admitted, `link` is the turn's place (None: it ran as a plain job)."""

    def __init__(self, sessions: SessionAdmission, peer: str, added: int, follows: ChainLink | None) -> None:
        self.sessions, self.admission = sessions, sessions.admission
        self.peer, self.added, self.follows = peer, added, follows
        self.link: ChainLink | None = None

    async def infer(self, inference: common_pb2.InferenceRequest) -> common_pb2.InferenceResult:
        """As Admission.infer: the job's result."""
        admitted = await self._begin(inference, streaming=False)
        result = await self.admission.result(admitted.job_id)
        if self._no_room(result):
            result = await self.admission.result((await self._plain_instead(inference, False)).job_id)
        return result

    async def stream(self, inference: common_pb2.InferenceRequest) -> AsyncIterator[Submitted | JobEvent]:
        """As Admission.stream: `Submitted`, then the job's events up to its result."""
        admitted = await self._begin(inference, streaming=True)
        async with contextlib.aclosing(self.admission.followed(admitted)) as events:
            async for event in events:
                if isinstance(event, Finished) and self._no_room(event.result):
                    break  # refused before it generated anything: a plain job answers instead
                yield event
            else:
                return
        plain = await self._plain_instead(inference, True)
        async with contextlib.aclosing(self.admission.followed(plain)) as events:
            async for event in events:
                if not isinstance(event, Submitted):  # the client was told of the first job already
                    yield event

    def _no_room(self, result: common_pb2.InferenceResult) -> bool:
        """Whether the turn was refused for want of room for a session at the engines (every one at
        EXPERT_MAX_SESSIONS): a refusal the same job as a plain one would not meet."""
        return (
            self.link is not None
            and result.status == common_pb2.JOB_STATUS_FAILED
            and failure_code(result) is grpc.StatusCode.RESOURCE_EXHAUSTED
        )

    async def _plain_instead(self, inference: common_pb2.InferenceRequest, streaming: bool) -> Admitted:
        """The job again as a plain one, after its turn was refused; a session it had just opened
        ends (it holds nothing), a chain's session is left to the next continuation (which forks,
        the refused input being pending there)."""
        session_id, turn = self.link
        self.link = None
        if turn == 1:
            with contextlib.suppress(ServiceError):
                await self.sessions.end(session_id)
        log.info("no engine has room for the response's session: a plain job", session_id=session_id)
        return await self.admission.admit(inference, streaming=streaming)

    async def _begin(self, inference: common_pb2.InferenceRequest, streaming: bool) -> Admitted:
        if self.follows is not None:
            admitted = await self._continue(inference, streaming)
            if admitted is not None:
                return admitted
        return await self._open(inference, streaming)

    async def _continue(self, inference: common_pb2.InferenceRequest, streaming: bool) -> Admitted | None:
        """The job as the turn after the previous response's (None: its session moved on, ended or
        expired, and the conversation goes to a new session instead)."""
        session_id, turn = self.follows
        added = list(inference.messages)[len(inference.messages) - self.added :]
        try:
            admitted, number = await self.sessions.begin_request_turn(
                session_id, inference, streaming=streaming, messages=added, after_turn=turn
            )
        except NotLatest:
            log.info("response branches from an older turn: a new session", session_id=session_id)
            return None
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            return None
        self.link = ChainLink(session_id, number)
        return admitted

    async def _open(self, inference: common_pb2.InferenceRequest, streaming: bool) -> Admitted:
        """The job as the first turn of a new session holding the whole conversation; as a plain
        job when the owner's session limits leave no room for one."""
        settings = session_pb2.CreateSessionRequest(messages=inference.messages)
        if inference.HasField("model"):
            settings.model = inference.model
        try:
            session = await self.sessions.create(settings, self.peer, seeded=True)
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            log.info("no room for a response's session: a plain job", reason=exc.message)
            return await self.admission.admit(inference, streaming=streaming)
        try:
            admitted, number = await self.sessions.begin_request_turn(
                session.session_id, inference, streaming=streaming
            )
        except BaseException:  # refused: the new session holds nothing worth its place
            with contextlib.suppress(ServiceError):
                await self.sessions.end(session.session_id)
            raise
        self.link = ChainLink(session.session_id, number)
        return admitted
