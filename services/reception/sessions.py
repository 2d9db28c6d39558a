"""Sessions in Redis: each one's record (`expert:session:{id}`, a SessionRecord) holds everything a
conversation is: its settings, its messages, the tokens of its turns, the experts and sampling its
first turn fixed, the engine it is pinned to, and the turn running now. The record expires after
EXPERT_SESSION_IDLE_SECONDS without use; every change refreshes that.

The record is the session's one owner. An engine keeps a session's KV only as a cache of its
tokens: a turn sends the whole token history with its new messages (dispatch/turns.py), so an
engine that lost the KV (evicted, restarted, or a new engine after a failure) recomputes it and
answers the same.

Changes are optimistic transactions (WATCH / MULTI): an AppendInput racing the end of a turn never
loses either.

Whoever creates sessions (an API key, or with auth off a client address: `LimitOwner`) may hold at
most EXPERT_SESSION_MAX_PER_KEY live ones and create EXPERT_SESSION_CREATE_PER_MINUTE a minute. Its
live sessions are a Redis set of their record keys, checked and added to in the one script that
creates a record, so concurrent creations cannot pass the cap. A session that ended or expired
frees its place by itself: the script drops members whose record is gone before it counts, and
the set expires with the last of them.

A session belongs to the API key that created it (`owner_key_id`); who may reach it is
libs.auth.policy's rule, applied by the session calls (admission/sessions.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from redis.asyncio import Redis
from redis.exceptions import WatchError

from libs.auth.limits import GCRA_LUA, WINDOW_MS, LimitOwner
from libs.errors import ServiceError, failed_precondition, not_found, resource_exhausted
from libs.gen.expert.v1 import common_pb2, session_pb2, session_state_pb2
from libs.limits import SAMPLING_FIELDS
from libs.timestamps import timestamp

PREFIX = "expert:session:"
T = TypeVar("T")
# How a reply may end and still be continued by a turn that appends nothing.
_CONTINUABLE = (
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORT,
    common_pb2.FINISH_REASON_TIMEOUT,
)


# KEYS: the owner's live sessions (a set of record keys), its creations TAT, the new record
# ARGV: most live sessions (0: no cap), creations per minute (0: no limit), window ms, the record,
# its TTL s -> {1, 0, 0} created; {0, 0, 1} at the cap; {0, ms to wait, 2} over the rate; {0, 0, 3}
# the id is taken. The members' records are read by name: a standalone Redis, as everywhere here.
_CREATE = (
    GCRA_LUA
    + """
local cap, rate, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if cap > 0 then
  for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if redis.call('EXISTS', key) == 0 then redis.call('SREM', KEYS[1], key) end
  end
  if redis.call('SCARD', KEYS[1]) >= cap then return {0, 0, 1} end
end
if rate > 0 then
  local wait = gcra(KEYS[2], now_ms(), rate, window)
  if wait > 0 then return {0, wait, 2} end
end
if not redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[5], 'NX') then return {0, 0, 3} end
if cap > 0 then
  redis.call('SADD', KEYS[1], KEYS[3])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
end
return {1, 0, 0}
"""
)


@dataclass(frozen=True)
class SessionLimits:
    idle_seconds: float  # EXPERT_SESSION_IDLE_SECONDS
    max_tokens: int  # EXPERT_SESSION_MAX_TOKENS (0: the model's context window)
    max_per_key: int = 100  # EXPERT_SESSION_MAX_PER_KEY: live sessions per owner (0: no cap)
    create_per_minute: int = 60  # EXPERT_SESSION_CREATE_PER_MINUTE: per owner (0: no limit)


def session_key(session_id: str) -> str:
    return PREFIX + session_id


class SessionStore:
    def __init__(self, redis: Redis, limits: SessionLimits) -> None:
        self.redis = redis
        self.limits = limits
        self._create = redis.register_script(_CREATE)

    @property
    def _ttl(self) -> int:
        return max(1, math.ceil(self.limits.idle_seconds))

    async def create(
        self,
        session_id: str,
        settings: session_pb2.CreateSessionRequest,
        owner: LimitOwner | None = None,
        owner_key_id: str = "",
    ) -> session_state_pb2.SessionRecord:
        """A new session's record, belonging to the API key `owner_key_id` ("": to none), counted
        against `owner`'s limits (None: none apply, as for the services' own sessions in tests).
        RESOURCE_EXHAUSTED naming the limit and its setting when the owner holds
        EXPERT_SESSION_MAX_PER_KEY sessions or is over its creation rate (then with the seconds to
        wait)."""
        now = time.time()
        record = session_state_pb2.SessionRecord(
            session_id=session_id,
            settings=settings,
            pending=settings.messages,
            created_at=now,
            last_used_at=now,
            model=settings.model,
            owner_key_id=owner_key_id,
        )
        record.settings.ClearField("messages")
        if settings.HasField("system_prompt"):
            record.messages.append(common_pb2.ChatMessage(role="system", content=settings.system_prompt))
        if owner is None:
            await self.redis.set(session_key(session_id), record.SerializeToString(), ex=self._ttl, nx=True)
            return record
        if self.limits.max_per_key > 0:
            record.owner_sessions_key = owner.redis_prefix + ":sessions"
        created, wait_ms, which = await self._create(
            keys=[
                owner.redis_prefix + ":sessions",
                owner.redis_prefix + ":session-creations",
                session_key(session_id),
            ],
            args=[
                self.limits.max_per_key,
                self.limits.create_per_minute,
                WINDOW_MS,
                record.SerializeToString(),
                self._ttl,
            ],
        )
        if not created:
            raise self._refusal(owner, which, wait_ms, session_id)
        return record

    def _refusal(self, owner: LimitOwner, which: int, wait_ms: int, session_id: str) -> Exception:
        limits = self.limits
        if which == 1:
            return resource_exhausted(
                f"{owner.name} holds {limits.max_per_key} sessions, the most EXPERT_SESSION_MAX_PER_KEY "
                f"allows: end one (EndSession), or one ends by itself after {self._ttl} s idle "
                "(EXPERT_SESSION_IDLE_SECONDS)"
            )
        if which == 2:
            wait_s = max(1, math.ceil(wait_ms / 1000))
            return resource_exhausted(
                f"{owner.name} is over its limit of {limits.create_per_minute} new sessions per minute "
                f"(EXPERT_SESSION_CREATE_PER_MINUTE); retry in {wait_s} s",
                retry_after_s=wait_s,
            )
        return failed_precondition(f"session {session_id!r} exists already")

    async def get(self, session_id: str) -> session_state_pb2.SessionRecord:
        raw = await self.redis.get(session_key(session_id))
        if raw is None:
            raise unknown_session(session_id)
        return session_state_pb2.SessionRecord.FromString(raw)

    async def append(
        self, session_id: str, messages: list[common_pb2.ChatMessage]
    ) -> session_state_pb2.SessionRecord:
        def change(record: session_state_pb2.SessionRecord) -> None:
            record.pending.extend(messages)

        return (await self._update(session_id, change))[0]

    async def begin_turn(
        self,
        session_id: str,
        job_id: str,
        *,
        messages: list[common_pb2.ChatMessage] | None = None,
        after_turn: int | None = None,
    ) -> session_state_pb2.SessionRecord:
        """Make `job_id` the session's running turn, taking what was appended as its input.
        FAILED_PRECONDITION while another turn runs, or when there is nothing to answer.

        With `after_turn`, the turn follows that one exactly (a Responses API continuation of the
        chain's latest response): `messages` are its input, in the same transaction, and NotLatest
        is raised when the session moved on (more turns, a running turn, or input appended
        meanwhile), so that nothing is appended to a conversation the caller does not hold."""

        def change(record: session_state_pb2.SessionRecord) -> None:
            if after_turn is not None:
                if record.turns != after_turn or record.job_id or record.pending:
                    raise NotLatest(session_id, after_turn)
                record.pending.extend(messages or [])
            if record.job_id:
                raise failed_precondition(
                    f"session {session_id} is generating (job {record.job_id}): wait for its end or "
                    "CancelGenerate it"
                )
            if not record.pending and not (record.turns and record.last_finish_reason in _CONTINUABLE):
                raise failed_precondition(
                    f"session {session_id} has nothing to answer: AppendInput first"
                    + (" (its last reply is complete)" if record.turns else "")
                )
            record.job_id = job_id
            record.turn_input.extend(record.pending)
            del record.pending[:]

        return (await self._update(session_id, change))[0]

    async def running_turn(self, session_id: str, job_id: str) -> session_state_pb2.SessionRecord | None:
        """The record, if `job_id` is its running turn (None: the session ended meanwhile)."""
        raw = await self.redis.get(session_key(session_id))
        if raw is None:
            return None
        record = session_state_pb2.SessionRecord.FromString(raw)
        return record if record.job_id == job_id else None

    async def end_turn(
        self,
        session_id: str,
        job_id: str,
        *,
        plan: common_pb2.ExpertPlan,
        placement: common_pb2.Placement,
        input_ids: list[int],
        output_ids: list[int],
        reply: str,
        finish_reason: int,
        usage: common_pb2.GenerationUsage,
        tool_calls: Sequence[common_pb2.ToolCall] = (),
        tools_shown: Sequence[common_pb2.Tool] | None = None,
    ) -> None:
        """Record a turn the engine answered: its tokens join the history, its input and reply (with
        the calls it made) the messages; the plan and the engine stay the session's. `tools_shown`:
        the tools the turn listed to the model (None: it listed none anew)."""

        def change(record: session_state_pb2.SessionRecord) -> None:
            if record.job_id != job_id:
                return
            if tools_shown is not None:
                del record.tools_shown[:]
                record.tools_shown.extend(tools_shown)
            if record.turn_input:
                record.messages.extend(record.turn_input)
                record.messages.append(
                    common_pb2.ChatMessage(role="assistant", content=reply, tool_calls=tool_calls)
                )
            elif record.messages and record.messages[-1].role == "assistant":  # a cut reply went on
                record.messages[-1].content += reply
            record.token_ids.extend(input_ids)
            record.token_ids.extend(output_ids)
            del record.turn_input[:]
            record.turns += 1
            record.last_finish_reason = finish_reason
            record.last_usage.CopyFrom(usage)
            record.engine_id, record.engine_address = placement.engine_id, placement.address
            if not record.planned:
                record.plan.CopyFrom(plan)
                record.planned = True
            record.job_id = ""

        await self._update(session_id, change, missing_ok=True)

    async def abandon_turn(self, session_id: str, job_id: str) -> None:
        """A turn that produced nothing the engine confirmed: its input goes back to be answered next."""

        def change(record: session_state_pb2.SessionRecord) -> None:
            if record.job_id != job_id:
                return
            pending = [*record.turn_input, *record.pending]
            del record.turn_input[:]
            del record.pending[:]
            record.pending.extend(pending)
            record.job_id = ""

        await self._update(session_id, change, missing_ok=True)

    async def end(self, session_id: str) -> session_state_pb2.SessionRecord:
        """Delete the session; returns its last record (NOT_FOUND if there is none)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(session_key(session_id))
            pipe.delete(session_key(session_id))
            raw, _ = await pipe.execute()
        if raw is None:
            raise unknown_session(session_id)
        return session_state_pb2.SessionRecord.FromString(raw)

    async def _update(
        self,
        session_id: str,
        change: Callable[[session_state_pb2.SessionRecord], T],
        missing_ok: bool = False,
    ) -> tuple[session_state_pb2.SessionRecord | None, T | None]:
        key = session_key(session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        await pipe.unwatch()
                        if missing_ok:
                            return None, None
                        raise unknown_session(session_id)
                    record = session_state_pb2.SessionRecord.FromString(raw)
                    result = change(record)
                    record.last_used_at = time.time()
                    pipe.multi()
                    pipe.set(key, record.SerializeToString(), ex=self._ttl)
                    if record.owner_sessions_key:  # outlives this record, the last one used
                        pipe.expire(record.owner_sessions_key, self._ttl)
                    await pipe.execute()
                    return record, result
                except WatchError:
                    continue

    # -- what the API shows of a record --------------------------------------------------------

    def view(self, record: session_state_pb2.SessionRecord, ended: bool = False) -> session_pb2.Session:
        now = time.time()
        state = (
            session_pb2.SESSION_STATE_ENDED
            if ended
            else session_pb2.SESSION_STATE_GENERATING
            if record.job_id
            else session_pb2.SESSION_STATE_IDLE
        )
        session = session_pb2.Session(
            session_id=record.session_id,
            state=state,
            turns=record.turns,
            tokens=len(record.token_ids),
            engine_id=record.engine_id,
            experts=[
                common_pb2.ExpertRef(name=e.name, version=e.version, weight=e.weight)
                for e in record.plan.experts
            ],
            model=record.model,
            pending_messages=len(record.pending),
            created_at=timestamp(record.created_at),
            last_used_at=timestamp(record.last_used_at),
            idle_seconds=0.0 if record.job_id else max(0.0, now - record.last_used_at),
            last_finish_reason=record.last_finish_reason,
            job_id=record.job_id,
        )
        if not ended:
            session.expires_at.CopyFrom(timestamp(record.last_used_at + self.limits.idle_seconds))
        return session


def turn_request(
    record: session_state_pb2.SessionRecord, turn: session_pb2.GenerateStreamRequest
) -> common_pb2.InferenceRequest:
    """The job of a turn: the session's settings, its sampling with the turn's overrides, and the
    messages the turn answers (the whole conversation for the first turn, which the router plans)."""
    settings = record.settings
    request = common_pb2.InferenceRequest(
        force_experts=settings.force_experts, exclude_experts=settings.exclude_experts
    )
    for name in ("max_experts", "priority", "model"):
        if settings.HasField(name):
            setattr(request, name, getattr(settings, name))
    request.messages.extend(turn_messages(record))
    for sampling in (settings.sampling, turn.sampling):
        copy_sampling(sampling, "max_new_tokens", request, "max_tokens")
    if turn.HasField("response_format"):
        request.response_format.CopyFrom(turn.response_format)
    if turn.HasField("timeout_ms"):
        request.timeout_ms = turn.timeout_ms
    request.tools.extend(turn.tools)
    if turn.HasField("tool_choice"):
        request.tool_choice.CopyFrom(turn.tool_choice)
    if turn.HasField("parallel_tool_calls"):
        request.parallel_tool_calls = turn.parallel_tool_calls
    return request


def turn_messages(record: session_state_pb2.SessionRecord) -> list[common_pb2.ChatMessage]:
    """The messages a turn's job carries: the whole conversation for the first turn (which the
    router plans), the turn's input for a later one."""
    messages = list(record.turn_input) if record.turns else [*record.messages, *record.turn_input]
    if not messages:  # going on with a cut reply: the router is not asked again, the validation is
        messages = [record.messages[-1]] if record.messages else []
    return messages


def copy_sampling(source, source_max: str, target, target_max: str) -> None:
    """The sampling fields `source` sets explicitly, onto `target` (its stop strings replace the
    target's); `source_max` and `target_max` name the token limit on each side."""
    for name in SAMPLING_FIELDS:
        if source.HasField(name):
            setattr(target, name, getattr(source, name))
    if source.HasField(source_max):
        setattr(target, target_max, getattr(source, source_max))
    if source.stop:
        del target.stop[:]
        target.stop.extend(source.stop)


class NotLatest(ServiceError):
    """The session is no longer where a continuation expected it (see SessionStore.begin_turn)."""

    def __init__(self, session_id: str, after_turn: int) -> None:
        super().__init__(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"session {session_id} moved on from its turn {after_turn}",
        )


def unknown_session(session_id: str) -> ServiceError:
    """The refusal for a session that does not exist, or that the caller may not reach (another
    key's session is as unknown to it as one that never existed)."""
    return not_found(f"session {session_id!r} does not exist (it ended, or expired)")
