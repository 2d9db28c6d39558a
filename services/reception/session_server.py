"""SessionService: multi-turn conversations (docs/api.md#sessions).

A session's record lives in Redis (`sessions.py`). Each GenerateStream is one job through the same
pipeline as any request (queue, priorities, deadlines, cancellation, postproc), marked as a turn
of the session: the first turn is planned by the router and fixes the session's experts and
sampling; the engine it lands on becomes the session's, and keeps its KV between turns.

A client that reads a turn's text more slowly than the engine makes it never slows the engine (the
text goes through Redis), and never holds more than `stream_buffer` messages here: past that, the
turn is stopped (its text and KV kept, as a CancelGenerate would) and the call ends with
RESOURCE_EXHAUSTED once the client has read what was queued. The session stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc

from libs.auth.policy import Access, methods
from libs.errors import ServiceError, invalid_argument, invalid_arguments, resource_exhausted
from libs.gen.expert.v1 import common_pb2, session_pb2, session_state_pb2
from libs.job_results import failure_code
from libs.limits import SAMPLING_FIELDS
from libs.logging import get_logger
from services.reception.server import MAX_JOB_ID_CHARS, ReceptionServicer, Undecodable, tolerant
from services.reception.sessions import SessionStore, turn_request
from services.reception.stages import Stages
from services.reception.validation import MAX_MESSAGES, MAX_PROMPT_CHARS, validate

log = get_logger(__name__)

SERVICE = "expert.v1.SessionService"
_METHODS = ("CreateSession", "AppendInput", "GenerateStream", "CancelGenerate", "GetSession", "EndSession")
ACCESS = methods(SERVICE, dict.fromkeys(_METHODS, Access.INFER))
APPEND_ROLES = ("user", "system", "tool")
CANCEL_WAIT_S = 5.0  # how long CancelGenerate waits for the turn to settle
_END = object()


def _renamed(field: str) -> str:
    """A field of the turn's InferenceRequest as the session API names it."""
    name = field.removeprefix("request.")
    if name == "max_tokens":
        return "sampling.max_new_tokens"
    head = name.split("[")[0].split(".")[0]
    if head in (*SAMPLING_FIELDS, "stop"):
        return "sampling." + name
    return name


@contextlib.contextmanager
def _session_fields() -> Iterator[None]:
    """Reception's refusals of a turn's InferenceRequest, naming the session API's fields."""
    try:
        yield
    except ServiceError as exc:
        if not exc.violations:
            raise
        raise invalid_arguments([(_renamed(f), d) for f, d in exc.violations]) from None


def _check_settings(settings: session_pb2.CreateSessionRequest) -> None:
    """Reception's request rules on a new session's settings, as its turns will carry them. Its
    messages are checked like appended ones; a stand-in prompt takes their place here."""
    probe = turn_request(
        session_state_pb2.SessionRecord(settings=settings), session_pb2.GenerateStreamRequest()
    )
    del probe.messages[:]
    probe.prompt = "."
    with _session_fields():
        validate(probe)


def _messages(messages: list[common_pb2.ChatMessage], field: str) -> list[common_pb2.ChatMessage]:
    problems = []
    if len(messages) > MAX_MESSAGES:
        problems.append((field, f"at most {MAX_MESSAGES} messages, got {len(messages)}"))
    for i, message in enumerate(messages[:MAX_MESSAGES]):
        if message.role not in APPEND_ROLES:
            problems.append(
                (f"{field}[{i}].role", f"must be one of {', '.join(APPEND_ROLES)}, got {message.role!r}")
            )
        if not message.content.strip():
            problems.append((f"{field}[{i}].content", "must not be empty"))
        elif len(message.content) > MAX_PROMPT_CHARS:
            problems.append((f"{field}[{i}].content", f"at most {MAX_PROMPT_CHARS} characters"))
        if "\x00" in message.content:
            problems.append((f"{field}[{i}].content", "must not contain NUL bytes"))
    if problems:
        raise invalid_arguments(problems)
    return messages


def _session_id(request: object) -> str:
    if isinstance(request, Undecodable):
        raise invalid_argument(
            "request", f"not a valid request message ({request.reason}); text must be UTF-8"
        )
    session_id = request.session_id
    if not session_id:
        raise invalid_argument("session_id", "must not be empty")
    if len(session_id) > MAX_JOB_ID_CHARS:
        raise invalid_argument("session_id", f"at most {MAX_JOB_ID_CHARS} characters, got {len(session_id)}")
    return session_id


class SessionServicer:
    def __init__(
        self, reception: ReceptionServicer, store: SessionStore, stages: Stages, stream_buffer: int = 256
    ) -> None:
        self.reception = reception  # admission, job following and cancellation, shared with Infer
        self.store = store
        self.stages = stages
        self.stream_buffer = stream_buffer  # EXPERT_SESSION_STREAM_BUFFER

    async def CreateSession(self, request, context) -> session_pb2.CreateSessionResponse:
        if isinstance(request, Undecodable):
            raise invalid_argument("request", f"not a valid request message ({request.reason})")
        settings = session_pb2.CreateSessionRequest()
        settings.CopyFrom(request)
        _messages(list(settings.messages), "messages")
        if settings.HasField("system_prompt") and len(settings.system_prompt) > MAX_PROMPT_CHARS:
            raise invalid_argument("system_prompt", f"at most {MAX_PROMPT_CHARS} characters")
        _check_settings(settings)
        record = await self.store.create(uuid.uuid4().hex, settings)
        log.info("session created", session_id=record.session_id)
        return session_pb2.CreateSessionResponse(session=self.store.view(record))

    async def AppendInput(self, request, context) -> session_pb2.AppendInputResponse:
        session_id = _session_id(request)
        which = request.WhichOneof("input")
        if which is None:
            raise invalid_argument("input", "give text or a conversation")
        if which == "text":
            messages = _messages([common_pb2.ChatMessage(role="user", content=request.text)], "text")
        else:
            messages = _messages(list(request.conversation.messages), "conversation.messages")
            if not messages:
                raise invalid_argument("conversation.messages", "must not be empty")
        record = await self.store.append(session_id, messages)
        return session_pb2.AppendInputResponse(session=self.store.view(record))

    async def GetSession(self, request, context) -> session_pb2.GetSessionResponse:
        session_id = _session_id(request)
        record = await self.store.get(session_id)
        if record.job_id:
            await self._settle_stale_turn(record)
            record = await self.store.get(session_id)
        return session_pb2.GetSessionResponse(session=self.store.view(record))

    async def CancelGenerate(self, request, context) -> session_pb2.CancelGenerateResponse:
        session_id = _session_id(request)
        record = await self.store.get(session_id)
        if not record.job_id:
            return session_pb2.CancelGenerateResponse(cancelled=False, session=self.store.view(record))
        job_id = record.job_id
        await self.reception.cancel_job(job_id)
        # The turn settles (its text and tokens join the session) as its job ends: wait for that, so
        # the next GenerateStream can follow at once.
        deadline = time.monotonic() + CANCEL_WAIT_S
        while record.job_id == job_id and time.monotonic() < deadline:
            await self._settle_stale_turn(record)  # a turn cancelled while queued never runs
            record = await self.store.get(session_id)
            if record.job_id == job_id:
                await asyncio.sleep(0.02)
        return session_pb2.CancelGenerateResponse(cancelled=True, session=self.store.view(record))

    async def EndSession(self, request, context) -> session_pb2.EndSessionResponse:
        record = await self.store.end(_session_id(request))
        if record.job_id:
            with contextlib.suppress(ServiceError):
                await self.reception.cancel_job(record.job_id)
        if record.engine_address:
            # The engine's KV goes now; if the engine cannot be reached, its idle timeout frees it.
            try:
                await self.stages.release_session(record.engine_address, record.session_id)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "engine did not release the session", session_id=record.session_id, error=exc.details()
                )
        log.info("session ended", session_id=record.session_id, turns=record.turns)
        return session_pb2.EndSessionResponse(session=self.store.view(record, ended=True))

    async def GenerateStream(self, request, context) -> None:
        session_id = _session_id(request)
        await self._settle_stale_turn(await self.store.get(session_id))
        job_id = uuid.uuid4().hex
        record = await self.store.begin_turn(session_id, job_id)
        try:
            with _session_fields():  # the admission validates the turn, as any request
                await self.reception._admit(
                    turn_request(record, request), streaming=True, job_id=job_id, session_id=session_id
                )
        except BaseException:
            await self.store.abandon_turn(session_id, job_id)
            raise
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
                self.reception._cancel_in_background(job_id)

    async def _settle_stale_turn(self, record: session_state_pb2.SessionRecord) -> None:
        """A turn whose job ended without the pipeline settling it (cancelled while queued, swept
        at its deadline, dead-lettered) gives its input back, so the session is not left busy."""
        if not record.job_id:
            return
        job = await self.reception.jobs.get(record.job_id)
        if job is None or job.final:
            await self.store.abandon_turn(record.session_id, record.job_id)

    async def _produce(self, job_id: str, session_id: str, queue: asyncio.Queue) -> None:
        """The turn's events as messages, into `queue`; a full queue (the client reads too slowly)
        stops the turn and ends the call with the reason."""
        try:
            async for message in self._turn_messages(job_id, session_id):
                try:
                    queue.put_nowait(message)
                except asyncio.QueueFull:
                    await self.reception.cancel_job(job_id)
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
        async for kind, fields in self.reception._events(job_id):
            if kind == b"delta":
                delta = common_pb2.ChoiceDelta.FromString(fields[b"delta"])
                if delta.text:
                    yield session_pb2.GenerateStreamResponse(text=delta.text)
            elif kind == b"restart":
                yield session_pb2.GenerateStreamResponse(restarted_attempt=int(fields[b"attempt"]))
            elif kind == b"result":
                result = common_pb2.InferenceResult.FromString(fields[b"result"])
                _raise_refusal(result)
                end = session_pb2.TurnEnd(
                    job_id=job_id,
                    finish_reason=result.finish_reason,
                    text=result.text,
                    experts=result.experts,
                    error=result.error,
                )
                with contextlib.suppress(ServiceError):  # ended meanwhile: the end says the rest
                    record = await self.store.get(session_id)
                    end.session.CopyFrom(self.store.view(record))
                    if record.turns and not record.job_id:
                        end.usage.CopyFrom(record.last_usage)
                yield session_pb2.GenerateStreamResponse(end=end)
                return


def _raise_refusal(result: common_pb2.InferenceResult) -> None:
    """A turn a stage refused ends the call with that refusal (the session limit, a bad format)."""
    code = failure_code(result)
    if result.status != common_pb2.JOB_STATUS_FAILED or code is None:
        return
    if result.error_fields:
        raise invalid_arguments([(f.field, f.description) for f in result.error_fields])
    raise ServiceError(code, result.error)


def add_to_server(servicer: SessionServicer, server: grpc.aio.Server) -> str:
    """Register the servicer with tolerant deserializers (bad UTF-8 is INVALID_ARGUMENT)."""
    handlers = {}
    for name in _METHODS:
        kind = (
            grpc.unary_stream_rpc_method_handler
            if name == "GenerateStream"
            else grpc.unary_unary_rpc_method_handler
        )
        request, response = getattr(session_pb2, f"{name}Request"), getattr(session_pb2, f"{name}Response")
        handlers[name] = kind(getattr(servicer, name), tolerant(request), response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    return SERVICE
