"""A session's calls (docs/api.md#sessions) without gRPC: creating it, appending input, admitting a
turn as a job, following and cancelling the turn, ending the session. SessionService
(session_server.py) adapts these to its messages.

The session's record lives in Redis (`sessions.py`). Each turn is one job through the same
admission and pipeline as any request (limits, queue, priorities, deadlines, cancellation,
postproc), marked as a turn of the session; how the dispatcher runs it is the session's turn policy
(dispatch/turns.py).

A session belongs to the API key that created it: every call naming a session reaches it only as
libs.auth.policy's `may_reach` allows (another key's session is NOT_FOUND, as the Responses API
answers for another key's response; the internal token reaches all, and with auth off everyone).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc

from libs.auth.limits import LimitOwner
from libs.auth.policy import current_caller, may_reach, owning_key
from libs.errors import ServiceError, invalid_argument, invalid_arguments
from libs.gen.expert.v1 import common_pb2, session_pb2, session_state_pb2
from libs.job_results import failure_code
from libs.limits import SAMPLING_FIELDS
from libs.logging import get_logger
from services.reception.admission.core import MAX_JOB_ID_CHARS, Admission, Admitted
from services.reception.admission.validation import MAX_MESSAGES, MAX_PROMPT_CHARS, validate
from services.reception.job_events import JobEvent
from services.reception.sessions import SessionStore, turn_messages, turn_request, unknown_session

log = get_logger(__name__)

APPEND_ROLES = ("user", "system", "tool")
CANCEL_WAIT_S = 5.0  # how long cancelling a turn waits for it to settle


class SessionAdmission:
    """The session calls over `admission` (a turn is admitted and followed as any job) and the
    session records in `store`; `release_session(address, session_id)` frees a session's KV at
    its engine."""

    def __init__(
        self,
        admission: Admission,
        store: SessionStore,
        release_session: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self.admission = admission
        self.store = store
        self.release_session = release_session

    async def create(
        self, settings: session_pb2.CreateSessionRequest, peer: str = "", *, seeded: bool = False
    ) -> session_pb2.Session:
        """A new session with these settings (its first messages included), checked as its turns
        will be, and counted against its creator's session limits: the API key the call proved, or
        with auth off the client's address (`peer`, as gRPC names it). A `seeded` session's first
        messages are a whole conversation (replies included, as the Responses API forks one); its
        first turn's validation checks them."""
        if not seeded:
            _messages(list(settings.messages), "messages")
        if settings.HasField("system_prompt") and len(settings.system_prompt) > MAX_PROMPT_CHARS:
            raise invalid_argument("system_prompt", f"at most {MAX_PROMPT_CHARS} characters")
        _check_settings(settings)
        caller = current_caller()
        record = await self.store.create(
            uuid.uuid4().hex, settings, LimitOwner.of(caller, peer), owning_key(caller)
        )
        log.info("session created", session_id=record.session_id)
        return self.store.view(record)

    async def append(
        self, session_id: str, messages: list[common_pb2.ChatMessage], field: str
    ) -> session_pb2.Session:
        """Append input for the next turn; `field` names the messages in refusals."""
        if not _messages(messages, field):
            raise invalid_argument(field, "must not be empty")
        await self._reachable(session_id)
        return self.store.view(await self.store.append(session_id, messages))

    async def get(self, session_id: str) -> session_pb2.Session:
        record = await self._reachable(session_id)
        if record.job_id:
            await self._settle_stale_turn(record)
            record = await self.store.get(session_id)
        return self.store.view(record)

    # -- a turn --------------------------------------------------------------------------------

    async def begin_turn(self, session_id: str, turn: session_pb2.GenerateStreamRequest) -> str:
        """Start a turn answering what was appended: admitted as a job of the session (validated
        as any request, its refusals naming the session API's fields). Returns its job id."""
        await self._settle_stale_turn(await self._reachable(session_id))
        job_id = uuid.uuid4().hex
        record = await self.store.begin_turn(session_id, job_id)
        with _session_fields():
            await self._admit(record, job_id, turn_request(record, turn), streaming=True)
        return job_id

    async def begin_request_turn(
        self,
        session_id: str,
        request: common_pb2.InferenceRequest,
        *,
        streaming: bool,
        messages: list[common_pb2.ChatMessage] | None = None,
        after_turn: int | None = None,
    ) -> tuple[Admitted, int]:
        """Start a turn whose job is `request` (an OpenAI front's; its messages are replaced by the
        turn's), its refusals naming the request's own fields. With `after_turn` the turn appends
        `messages` right after that turn, or raises NotLatest (SessionStore.begin_turn). Returns
        the admitted job and the turn's number."""
        await self._settle_stale_turn(await self._reachable(session_id))
        job_id = uuid.uuid4().hex
        record = await self.store.begin_turn(session_id, job_id, messages=messages, after_turn=after_turn)
        job = common_pb2.InferenceRequest()
        job.CopyFrom(request)
        del job.messages[:]
        job.messages.extend(turn_messages(record))
        return await self._admit(record, job_id, job, streaming=streaming), record.turns + 1

    async def _admit(
        self,
        record: session_state_pb2.SessionRecord,
        job_id: str,
        job: common_pb2.InferenceRequest,
        streaming: bool,
    ) -> Admitted:
        """Admit the turn `job_id` just begun; refused, its input goes back to the session."""
        try:
            return await self.admission.admit(
                job, streaming=streaming, job_id=job_id, session_id=record.session_id
            )
        except BaseException:
            await self.store.abandon_turn(record.session_id, job_id)
            raise

    def follow_turn(self, job_id: str) -> AsyncIterator[JobEvent]:
        """The turn's job events, up to its result."""
        return self.admission.follow(job_id)

    async def turn_end(
        self, job_id: str, session_id: str, result: common_pb2.InferenceResult
    ) -> session_pb2.TurnEnd:
        """The end of a turn whose job finished, with the session as it is now; a turn that failed
        raises its refusal instead."""
        raise_turn_failure(result)
        end = session_pb2.TurnEnd(
            job_id=job_id,
            finish_reason=result.finish_reason,
            text=result.text,
            experts=result.experts,
            error=result.error,
            tool_calls=result.choices[0].tool_calls if result.choices else [],
        )
        with contextlib.suppress(ServiceError):  # ended meanwhile: the end says the rest
            record = await self.store.get(session_id)
            end.session.CopyFrom(self.store.view(record))
            if record.turns and not record.job_id:
                end.usage.CopyFrom(record.last_usage)
        return end

    async def stop_turn(self, job_id: str) -> None:
        """Stop the turn where it is (its text and KV are kept, as a CancelGenerate would)."""
        await self.admission.cancel_job(job_id)

    def abandon_turn(self, job_id: str) -> None:
        """The turn's caller went away: stop its job without waiting."""
        self.admission.cancel_in_background(job_id)

    async def cancel_turn(self, session_id: str) -> tuple[bool, session_pb2.Session]:
        """Stop the running turn, if any, and wait (up to CANCEL_WAIT_S) for it to settle, so that
        the next turn can follow at once. Whether a turn was running, and the session after."""
        record = await self._reachable(session_id)
        if not record.job_id:
            return False, self.store.view(record)
        job_id = record.job_id
        await self.admission.cancel_job(job_id)
        # The turn settles (its text and tokens join the session) as its job ends.
        deadline = time.monotonic() + CANCEL_WAIT_S
        while record.job_id == job_id and time.monotonic() < deadline:
            await self._settle_stale_turn(record)  # a turn cancelled while queued never runs
            record = await self.store.get(session_id)
            if record.job_id == job_id:
                await asyncio.sleep(0.02)
        return True, self.store.view(record)

    async def end(self, session_id: str) -> session_pb2.Session:
        """Delete the session: its running turn is cancelled and its engine frees its KV."""
        await self._reachable(session_id)  # its owner never changes: checked before, still true at the end
        record = await self.store.end(session_id)
        if record.job_id:
            with contextlib.suppress(ServiceError):
                await self.admission.cancel_job(record.job_id)
        if record.engine_address:
            # The engine's KV goes now; if the engine cannot be reached, its idle timeout frees it.
            try:
                await self.release_session(record.engine_address, record.session_id)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "engine did not release the session", session_id=record.session_id, error=exc.details()
                )
        log.info("session ended", session_id=record.session_id, turns=record.turns)
        return self.store.view(record, ended=True)

    async def _reachable(self, session_id: str) -> session_state_pb2.SessionRecord:
        """The session's record, if the current caller may reach it; NOT_FOUND, as for a session
        that does not exist, when it is another key's."""
        record = await self.store.get(session_id)
        if not may_reach(current_caller(), record.owner_key_id):
            raise unknown_session(session_id)
        return record

    async def _settle_stale_turn(self, record: session_state_pb2.SessionRecord) -> None:
        """A turn whose job ended without the pipeline settling it (cancelled while queued, swept
        at its deadline, dead-lettered) gives its input back, so the session is not left busy."""
        if record.job_id and await self.admission.has_ended(record.job_id):
            await self.store.abandon_turn(record.session_id, record.job_id)


def check_session_id(session_id: str) -> str:
    """The session id a call names, refused when empty or longer than any id we mint."""
    if not session_id:
        raise invalid_argument("session_id", "must not be empty")
    if len(session_id) > MAX_JOB_ID_CHARS:
        raise invalid_argument("session_id", f"at most {MAX_JOB_ID_CHARS} characters, got {len(session_id)}")
    return session_id


def raise_turn_failure(result: common_pb2.InferenceResult) -> None:
    """A turn a stage refused ends the call with that refusal (the session limit, a bad format)."""
    code = failure_code(result)
    if result.status != common_pb2.JOB_STATUS_FAILED or code is None:
        return
    if result.error_fields:
        raise invalid_arguments([(f.field, f.description) for f in result.error_fields])
    raise ServiceError(code, result.error)


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
