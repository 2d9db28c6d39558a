"""SessionService: multi-turn conversations (docs/api.md#sessions), an adapter over the session
calls of the admission core (admission/sessions.py): each method reads its request message, makes
the call and answers with its response message.

A client that reads a turn's text more slowly than the engine makes it never slows the engine (the
text goes through Redis), and never holds more than `stream_buffer` messages here: past that, the
turn is stopped (its text and KV kept, as a CancelGenerate would) and the call ends with
RESOURCE_EXHAUSTED once the client has read what was queued. The session stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from libs.auth.policy import Access, methods
from libs.errors import invalid_argument, resource_exhausted
from libs.gen.expert.v1 import common_pb2, session_pb2
from services.reception.admission.sessions import SessionAdmission, check_session_id
from services.reception.job_events import Delta, Finished, Restarted
from services.reception.tolerant import add_tolerant_service, parsed

SERVICE = "expert.v1.SessionService"
_METHODS = ("CreateSession", "AppendInput", "GenerateStream", "CancelGenerate", "GetSession", "EndSession")
ACCESS = methods(SERVICE, dict.fromkeys(_METHODS, Access.INFER))
_END = object()


def _session_id(request: object) -> str:
    return check_session_id(parsed(request).session_id)


class SessionServicer:
    """SessionService's methods over `sessions`; `stream_buffer` is EXPERT_SESSION_STREAM_BUFFER."""

    def __init__(self, sessions: SessionAdmission, stream_buffer: int = 256) -> None:
        self.sessions = sessions
        self.stream_buffer = stream_buffer

    async def CreateSession(self, request, context) -> session_pb2.CreateSessionResponse:
        settings = session_pb2.CreateSessionRequest()
        settings.CopyFrom(parsed(request))
        created = await self.sessions.create(settings, peer=context.peer())
        return session_pb2.CreateSessionResponse(session=created)

    async def AppendInput(self, request, context) -> session_pb2.AppendInputResponse:
        session_id = _session_id(request)
        which = request.WhichOneof("input")
        if which is None:
            raise invalid_argument("input", "give text or a conversation")
        if which == "text":
            messages, field = [common_pb2.ChatMessage(role="user", content=request.text)], "text"
        else:
            messages, field = list(request.conversation.messages), "conversation.messages"
        return session_pb2.AppendInputResponse(
            session=await self.sessions.append(session_id, messages, field)
        )

    async def GetSession(self, request, context) -> session_pb2.GetSessionResponse:
        return session_pb2.GetSessionResponse(session=await self.sessions.get(_session_id(request)))

    async def CancelGenerate(self, request, context) -> session_pb2.CancelGenerateResponse:
        cancelled, session = await self.sessions.cancel_turn(_session_id(request))
        return session_pb2.CancelGenerateResponse(cancelled=cancelled, session=session)

    async def EndSession(self, request, context) -> session_pb2.EndSessionResponse:
        return session_pb2.EndSessionResponse(session=await self.sessions.end(_session_id(request)))

    async def GenerateStream(self, request, context) -> None:
        session_id = _session_id(request)
        job_id = await self.sessions.begin_turn(session_id, request)
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.stream_buffer)
        producer = asyncio.create_task(self._produce(job_id, session_id, queue))
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                await context.write(item)
        finally:
            producer.cancel()
            with contextlib.suppress(BaseException):
                await producer
            if not ended:  # the client went away: do not leave the turn running
                self.sessions.abandon_turn(job_id)

    async def _produce(self, job_id: str, session_id: str, queue: asyncio.Queue) -> None:
        """The turn's events as messages, into `queue`; a full queue (the client reads too slowly)
        stops the turn and ends the call with the reason."""
        try:
            async for message in self._turn_messages(job_id, session_id):
                try:
                    queue.put_nowait(message)
                except asyncio.QueueFull:
                    await self.sessions.stop_turn(job_id)
                    await queue.put(
                        resource_exhausted(
                            f"the client read the turn's text too slowly ({self.stream_buffer} messages "
                            "behind, EXPERT_SESSION_STREAM_BUFFER): the turn was stopped with what it had "
                            "generated, which the session keeps; the session is usable"
                        )
                    )
                    return
            await queue.put(_END)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            await queue.put(exc)

    async def _turn_messages(
        self, job_id: str, session_id: str
    ) -> AsyncIterator[session_pb2.GenerateStreamResponse]:
        async for event in self.sessions.follow_turn(job_id):
            match event:
                case Delta(delta) if delta.text:
                    yield session_pb2.GenerateStreamResponse(text=delta.text)
                case Restarted(attempt):
                    yield session_pb2.GenerateStreamResponse(restarted_attempt=attempt)
                case Finished(result):
                    end = await self.sessions.turn_end(job_id, session_id, result)
                    yield session_pb2.GenerateStreamResponse(end=end)
                    return


def add_to_server(servicer: SessionServicer, server: grpc.aio.Server) -> str:
    """Register the servicer (bad UTF-8 is INVALID_ARGUMENT: tolerant.py)."""
    return add_tolerant_service(
        server, SERVICE, servicer, _METHODS, session_pb2, streaming=("GenerateStream",)
    )
