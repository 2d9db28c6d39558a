"""Job records and job events in Redis.

- `expert:job:{id}`: a hash with the request, status, priority, timestamps, attempts, result, error;
- `expert:job:{id}:text`: the output so far of the first choice (appended chunk by chunk);
- `expert:job:{id}:events`: a stream of status changes, choice deltas (ChoiceDelta: a choice's new
  text and its logprobs), restarts and the final result, which `follow` reads as typed events
  (job_events.py) for InferStream and the other streams, whoever dispatches the job;
- `expert:job:{id}:result`: a stream holding only the final result, which Infer waits on (one
  wake-up per job instead of one per token).
All four expire after the job TTL; with EXPERT_STORE_REQUEST_TEXT=false, the record keeps only the
SHA-256s of the request and the output once the job ends, the streams expire within a minute, and
the job is noted for the rewrite of Redis's append-only file that takes the texts off disk
(redis_compaction.py).
No script recreates the keys of a job whose record is gone. Status changes are atomic (a Lua
script): a final status is never overwritten, so a cancellation and a completion racing each other
resolve to exactly one outcome.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.auth.limits import KeyLimiter
from libs.gen.expert.v1 import common_pb2
from libs.logging import get_logger
from libs.timestamps import timestamp
from services.reception import redis_compaction as compaction
from services.reception.audit import AuditLog
from services.reception.job_events import JobEvent, decode_event

log = get_logger(__name__)

PREFIX = "expert:job:"
CANCEL_CHANNEL = "expert:cancel"
# Job ids by deadline (a sorted set), so that a job whose deadline passes ends TIMED_OUT even when
# no dispatcher is free to pick it up, or the one that ran it is gone (JobStore.sweep_overdue).
DEADLINES = "expert:jobs:deadlines"
# How long a running job's writes wait for Redis to come back before they give up.
WRITE_PATIENCE_S = 30.0
# With the texts kept out of Redis, how long a finished job's streams still hold them: the
# followers of a job (Infer, InferStream) read its result as it is written, or reconnect within this.
FOLLOWER_GRACE_S = 60
# How long a follower waits on a silent job before it checks that the record still exists. Each
# waiting caller costs a read and a check per period: at one second that was a third of reception's
# Redis commands per job under load, for records that expire after hours.
FOLLOW_CHECK_MS = 10_000
FINAL = (
    common_pb2.JOB_STATUS_COMPLETED,
    common_pb2.JOB_STATUS_FAILED,
    common_pb2.JOB_STATUS_CANCELLED,
    common_pb2.JOB_STATUS_TIMED_OUT,
)

# Shared by the scripts below: whether the job hash `key` holds a final status.
_IS_FINAL = (
    "local FINAL = {"
    + ", ".join(f"['{status}'] = true" for status in FINAL)
    + "}\nlocal function is_final(key) return FINAL[redis.call('HGET', key, 'status')] ~= nil end\n"
)

# Every script that writes a key of a job checks that the job's hash exists (a write to an expired
# or evicted job must not recreate its keys without a TTL) and gives the events stream the job TTL
# if it has none (an XADD recreates a stream that was evicted, without one).

# KEYS: job hash, its events; ARGV: new status, now, ttl
# -> 1 if changed (and announced), 0 if the job was final, -1 if it is gone
_SET_STATUS = (
    _IS_FINAL
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if is_final(KEYS[1]) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'kind', 'status', 'status', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3], 'NX')
return 1
"""
)


# KEYS: job hash, its text, its events; ARGV: new status ("" to keep it), now, "1" for a delivery, ttl,
# "1" for an attempt that goes on from the text so far (no restart event, the text kept)
# -> the hash's fields after counting the attempt (and the delivery); a final job's fields as they
# are; nothing when the job is gone
_BEGIN = (
    _IS_FINAL
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
if is_final(KEYS[1]) then return redis.call('HGETALL', KEYS[1]) end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[1], 'deliveries', 1) end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if attempts > 1 and ARGV[5] ~= '1' then
  redis.call('DEL', KEYS[2])
  redis.call('XADD', KEYS[3], '*', 'kind', 'restart', 'attempt', attempts)
end
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2])
  redis.call('XADD', KEYS[3], '*', 'kind', 'status', 'status', ARGV[1])
end
redis.call('EXPIRE', KEYS[3], ARGV[4], 'NX')
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: job hash, its text, its events; ARGV: the delta (a ChoiceDelta), the text it adds to the
# first choice ("" for another choice), ttl -> 1, or 0 if the job is gone or final (a late delta
# must not bring back a text that the end of the job removed)
_APPEND = (
    _IS_FINAL
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or is_final(KEYS[1]) then return 0 end
if ARGV[2] ~= '' then
  redis.call('APPEND', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
redis.call('XADD', KEYS[3], '*', 'kind', 'delta', 'delta', ARGV[1])
redis.call('EXPIRE', KEYS[3], ARGV[3], 'NX')
return 1
"""
)

# KEYS: job hash -> 1 if flagged, 0 if the job is gone
_FLAG_CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'cancel_requested', 1)
return 1
"""

# KEYS: job hash, its events, the deadline set, its result stream, its text, the set of jobs whose
# texts wait for the compaction of Redis's append-only file (redis_compaction.PENDING)
# ARGV: final status, now, result, error, job id, then "" to keep the job's texts, or: "redact", the
# request and the result without their texts (either may serialize to nothing), their SHA-256s,
# and how long followers may still read them
# -> 1 if recorded, 0 if the job was already final, -1 if it is gone
_FINISH = (
    _IS_FINAL
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if is_final(KEYS[1]) then return 0 end
local ttl = redis.call('TTL', KEYS[1])
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2], 'finished_at', ARGV[2],
           'result', ARGV[3], 'error', ARGV[4])
redis.call('XADD', KEYS[2], '*', 'kind', 'status', 'status', ARGV[1])
redis.call('XADD', KEYS[2], '*', 'kind', 'result', 'result', ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[5])
redis.call('XADD', KEYS[4], '*', 'kind', 'result', 'result', ARGV[3])
if ARGV[6] ~= '' then
  -- the texts leave the record now; the streams keep them for the followers still reading
  redis.call('HSET', KEYS[1], 'request', ARGV[7], 'result', ARGV[8],
             'request_sha256', ARGV[9], 'output_sha256', ARGV[10])
  redis.call('DEL', KEYS[5])
  ttl = math.min(ttl, tonumber(ARGV[11]))
  redis.call('EXPIRE', KEYS[2], ttl)
  -- due for the compaction once its streams are gone
  redis.call('ZADD', KEYS[6], tonumber(ARGV[2]) + ttl, ARGV[5])
end
redis.call('EXPIRE', KEYS[2], ttl, 'NX')
redis.call('EXPIRE', KEYS[4], ttl)
return 1
"""
)

# KEYS: job hash, its events, the deadline set, the queue stream ("" for none)
# ARGV: request, queued status, priority, now, ttl, deadline ("" for none), job id, reception ms,
# streaming ("1" or "0"), the API key's id ("" for none), the session it is a turn of ("" for none)
_ADMIT = """
redis.call('HSET', KEYS[1], 'request', ARGV[1], 'status', ARGV[2], 'priority', ARGV[3],
           'submitted_at', ARGV[4], 'updated_at', ARGV[4], 'attempts', 0, 'reception_ms', ARGV[8],
           'streaming', ARGV[9], 'key_id', ARGV[10], 'session_id', ARGV[11])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('XADD', KEYS[2], '*', 'kind', 'status', 'status', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[5])
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[3], ARGV[6], ARGV[7]) end
if KEYS[4] ~= '' then redis.call('XADD', KEYS[4], '*', 'job_id', ARGV[7]) end
return 1
"""


def job_key(job_id: str) -> str:
    return PREFIX + job_id


def events_key(job_id: str) -> str:
    return PREFIX + job_id + ":events"


def result_key(job_id: str) -> str:
    return PREFIX + job_id + ":result"


def text_key(job_id: str) -> str:
    return PREFIX + job_id + ":text"


def job_deadline(
    request: common_pb2.InferenceRequest, submitted_at: float, default_timeout_s: float | None
) -> float | None:
    """When the job must end: submission + timeout_ms, or + the default timeout (None: never)."""
    if request.HasField("timeout_ms"):
        return submitted_at + request.timeout_ms / 1000
    return None if default_timeout_s is None else submitted_at + default_timeout_s


@dataclass
class JobRecord:
    job_id: str
    request: common_pb2.InferenceRequest
    status: int
    priority: int
    submitted_at: float
    updated_at: float
    finished_at: float | None
    attempts: int  # runs of the job so far: one per delivery and one per engine it failed over to
    error: str
    result: common_pb2.InferenceResult | None
    cancel_requested: bool = False
    reception_ms: float = 0.0  # reception's stage (parse, validate, normalize, job id) for this job
    streaming: bool = False  # a client shows its tokens as they come (InferStream)
    deliveries: int = 0  # times a dispatcher took the job from the queue (a reclaim is another)
    key_id: str | None = None  # the API key that submitted the job (None: auth off, or a service)
    session_id: str = ""  # the session the job is a turn of ("": none)

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def to_proto(self, text: str) -> common_pb2.Job:
        job = common_pb2.Job(
            job_id=self.job_id,
            status=self.status,
            submitted_at=timestamp(self.submitted_at),
            updated_at=timestamp(self.updated_at),
            priority=self.priority,
            attempts=self.attempts,
            text=text,
            error=self.error,
        )
        if self.finished_at is not None:
            job.finished_at.CopyFrom(timestamp(self.finished_at))
        if self.result is not None:
            job.result.CopyFrom(self.result)
        return job


def _record(job_id: str, fields: dict[bytes, bytes]) -> JobRecord | None:
    if not fields:
        return None
    finished = fields.get(b"finished_at")
    return JobRecord(
        job_id=job_id,
        request=common_pb2.InferenceRequest.FromString(fields[b"request"]),
        status=int(fields[b"status"]),
        priority=int(fields[b"priority"]),
        submitted_at=float(fields[b"submitted_at"]),
        updated_at=float(fields[b"updated_at"]),
        finished_at=float(finished) if finished else None,
        attempts=int(fields.get(b"attempts", 0)),
        error=fields.get(b"error", b"").decode(),
        result=common_pb2.InferenceResult.FromString(fields[b"result"]) if fields.get(b"result") else None,
        cancel_requested=fields.get(b"cancel_requested") == b"1",
        reception_ms=float(fields.get(b"reception_ms") or 0.0),
        streaming=fields.get(b"streaming") == b"1",
        deliveries=int(fields.get(b"deliveries", 0)),
        key_id=fields.get(b"key_id", b"").decode() or None,
        session_id=fields.get(b"session_id", b"").decode(),
    )


class JobExpired(Exception):
    """The job's record is gone (its TTL passed) while it was being followed."""


class JobStore:
    def __init__(
        self,
        redis: Redis,
        ttl_s: int,
        default_timeout_s: float | None = None,
        on_finished: Callable[[common_pb2.InferenceResult], None] | None = None,
        store_text: bool = True,
        write_patience_s: float = WRITE_PATIENCE_S,
        audit: AuditLog | None = None,
        limiter: KeyLimiter | None = None,
        follower_grace_s: int = FOLLOWER_GRACE_S,
        follow_check_ms: int = FOLLOW_CHECK_MS,
    ) -> None:
        self.redis = redis
        self.follow_check_ms = follow_check_ms
        # Charged, when a job ends, with the tokens it generated for its API key (one owner of the
        # tokens-per-minute count, whoever ends the job).
        self.limiter = limiter
        # Given each job's final result once, with its request (docs/operations.md#audit-log).
        self.audit = audit
        self.write_patience_s = write_patience_s
        # False: a job's prompt and output leave Redis when it ends (EXPERT_STORE_REQUEST_TEXT):
        # its record keeps their SHA-256s, and its streams the texts for `follower_grace_s` only;
        # then the job is due for the compaction of Redis's append-only file (redis_compaction).
        self.store_text = store_text
        self.follower_grace_s = follower_grace_s
        self.ttl_s = ttl_s
        self.default_timeout_s = default_timeout_s  # for requests without timeout_ms
        # Told of each result this store records as a job's final one, whoever ended the job (the
        # pipeline, a CancelJob of a queued job, the queue's deadline sweep, the dead-letter path).
        self.on_finished = on_finished
        self._set_status = redis.register_script(_SET_STATUS)
        self._admit = redis.register_script(_ADMIT)
        self._finish = redis.register_script(_FINISH)
        self._append = redis.register_script(_APPEND)
        self._begin = redis.register_script(_BEGIN)
        self._flag_cancel = redis.register_script(_FLAG_CANCEL)

    async def create(
        self,
        job_id: str,
        request: common_pb2.InferenceRequest,
        priority: int,
        queue: str | None = None,
        reception_ms: float = 0.0,
        streaming: bool = False,
        key_id: str | None = None,
        session_id: str = "",
    ) -> float:
        """Write the job's record and, with `queue`, enqueue it there: one atomic script, so that a
        job is never queued without its record and admission takes one round trip. `reception_ms`
        is the time reception spent on the request before this write, for the job's metrics;
        `streaming` says a client shows the job's tokens as they come; `key_id` names the API key
        that submitted it (its audit line and its tokens-per-minute count); `session_id` the
        session the job is a turn of."""
        now = time.time()
        deadline = job_deadline(request, now, self.default_timeout_s)
        await self._admit(
            keys=[job_key(job_id), events_key(job_id), DEADLINES, queue or ""],
            args=[
                request.SerializeToString(),
                common_pb2.JOB_STATUS_QUEUED,
                priority,
                repr(now),
                self.ttl_s,
                "" if deadline is None else repr(deadline),
                job_id,
                repr(reception_ms),
                "1" if streaming else "0",
                key_id or "",
                session_id,
            ],
        )
        return now

    async def get(self, job_id: str) -> JobRecord | None:
        return _record(job_id, await self.redis.hgetall(job_key(job_id)))

    async def begin(
        self, job_id: str, status: int | None = None, *, delivery: bool = False, resume: bool = False
    ) -> JobRecord | None:
        """Start a run of the job: count the attempt (from the second on, readers are told to
        discard earlier text, unless the run `resume`s from it) and, for a dispatcher taking it from
        the queue, the delivery; move it to `status` if given; return the record, in one step. None
        when the job is gone; a final job is returned as it is, not counted."""
        reply = await self._write(
            self._begin,
            keys=[job_key(job_id), text_key(job_id), events_key(job_id)],
            args=[
                "" if status is None else status,
                repr(time.time()),
                "1" if delivery else "0",
                self.ttl_s,
                "1" if resume else "0",
            ],
        )
        return _record(job_id, dict(zip(reply[0::2], reply[1::2], strict=True))) if reply else None

    async def text(self, job_id: str) -> str:
        return (await self.redis.get(text_key(job_id)) or b"").decode("utf-8", errors="replace")

    async def set_status(self, job_id: str, status: int) -> bool:
        """Move a live job to `status` and announce it; False when the job is already final (or gone)."""
        changed = await self._write(
            self._set_status,
            keys=[job_key(job_id), events_key(job_id)],
            args=[status, repr(time.time()), self.ttl_s],
        )
        return changed == 1

    async def append_delta(self, job_id: str, delta: common_pb2.ChoiceDelta) -> None:
        """Announce a choice's new text (the first choice's also goes to the job's text, which GetJob
        shows), in one command: this runs for every token."""
        await self._write(
            self._append,
            keys=[job_key(job_id), text_key(job_id), events_key(job_id)],
            args=[delta.SerializeToString(), delta.text.encode() if delta.index == 0 else b"", self.ttl_s],
        )

    async def request_cancel(self, job_id: str) -> None:
        """Flag the job and tell every dispatcher (the one running it stops it)."""
        await self._flag_cancel(keys=[job_key(job_id)])
        await self.redis.publish(CANCEL_CHANNEL, job_id.encode())

    async def finish(self, job_id: str, result: common_pb2.InferenceResult) -> bool:
        """Record the final result once: False if another outcome was recorded first. Status,
        result and the result event are written in one step, so a reader that sees a final status
        also sees its result."""
        payload = result.SerializeToString()
        # Read before the script, which takes the texts out of the record without store_text.
        need_request = not self.store_text or (self.audit is not None and self.audit.enabled)
        stored, raw_key_id = await self._write(
            lambda keys, args: self.redis.hmget(keys[0], args),
            keys=[job_key(job_id)],
            args=["request" if need_request else "status", "key_id"],
        )
        stored = stored if need_request else None
        key_id = raw_key_id.decode() if raw_key_id else None
        changed = await self._write(
            self._finish,
            keys=[
                job_key(job_id),
                events_key(job_id),
                DEADLINES,
                result_key(job_id),
                text_key(job_id),
                compaction.PENDING,
            ],
            args=[
                result.status,
                repr(time.time()),
                payload,
                result.error,
                job_id,
                *self._redacted(result, stored),
            ],
        )
        if changed == 1 and self.on_finished is not None:
            self.on_finished(result)
        if changed == 1 and self.audit is not None and self.audit.enabled:
            request = common_pb2.InferenceRequest.FromString(stored) if stored is not None else None
            self.audit.record(job_id, request, result, key_id=key_id)
        if changed == 1 and key_id and self.limiter is not None:
            await self._charge(key_id, result.metrics.output_tokens or result.tokens_generated)
        return changed == 1

    async def _charge(self, key_id: str, tokens: int) -> None:
        """Count a finished job's generated tokens against its key's tokens per minute. The job's
        outcome is already recorded: a Redis outage past the write patience loses this count (logged),
        never the job."""
        try:
            await self._write(
                lambda keys, args: self.limiter.charge(keys[0], args[0]), keys=[key_id], args=[tokens]
            )
        except (RedisConnectionError, RedisTimeoutError) as error:
            log.error(
                "generated tokens not charged to the API key", key_id=key_id, tokens=tokens, error=str(error)
            )

    async def _write(self, script, keys: list[str], args: list) -> object:
        """Run one of a running job's writes, waiting out a Redis restart for up to
        `write_patience_s` (the client retries only a moment): a job whose chunks or result cannot
        be stored meanwhile would otherwise be lost or failed for an outage that Redis recovers
        from. Admission does not wait: its caller gets UNAVAILABLE at once."""
        deadline = time.monotonic() + self.write_patience_s
        delay = 0.1
        while True:
            try:
                return await script(keys=keys, args=args)
            except (RedisConnectionError, RedisTimeoutError):
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _redacted(self, result: common_pb2.InferenceResult, stored: bytes | None) -> list[bytes | str | int]:
        """The _FINISH arguments that take the job's texts out of its record (`stored`: its
        request as stored), or [""] to keep them."""
        if self.store_text:
            return [""]
        request = common_pb2.InferenceRequest.FromString(stored or b"")
        request_sha256 = hashlib.sha256(stored or b"").hexdigest()
        for name in ("template", "body"):
            request.ClearField(name)
        request.prompt = ""
        del request.messages[:]
        kept = common_pb2.InferenceResult()
        kept.CopyFrom(result)
        kept.text = ""
        for choice in kept.choices:
            choice.text = ""
            del choice.logprobs[:]
            choice.validation.error = ""
        kept.reasoning_trace = ""  # it quotes the prompt's features and the plan
        kept.validation.error = ""  # a schema error quotes the output
        return [
            "redact",
            request.SerializeToString(),
            kept.SerializeToString(),
            request_sha256,
            hashlib.sha256(result.text.encode()).hexdigest(),
            self.follower_grace_s,
        ]

    async def follow(self, job_id: str, *, result_only: bool = False) -> AsyncIterator[JobEvent]:
        """The job's events (job_events.py), from the first, as they are written: status changes,
        choice deltas, restarts and the result. With `result_only`, only the result, read from its
        own stream (one wake-up per job instead of one per token). Raises JobExpired when the
        record is gone (looked at after each `follow_check_ms` without an event)."""
        key, last = (result_key(job_id) if result_only else events_key(job_id)), b"0-0"
        while True:
            batches = await self.redis.xread({key: last}, block=self.follow_check_ms, count=256)
            if not batches and not await self.redis.exists(job_key(job_id)):
                raise JobExpired(job_id)
            for _, entries in batches:
                for entry_id, fields in entries:
                    last = entry_id
                    event = decode_event(fields)
                    if event is not None:
                        yield event

    async def sweep_overdue(
        self, abandon_after_s: float, now: float | None = None, limit: int = 100
    ) -> list[tuple[str, int]]:
        """End, as TIMED_OUT, the jobs whose deadline passed and that nobody ended: a queued job at
        once (no worker may be free to find out), a job in a later state once `abandon_after_s`
        more have passed (its dispatcher died, or lost its Redis writes), with the output it made.
        Returns (job id, the status it was swept from). Whoever owned a job, this is safe: the
        final status is written once, so an owner that ends it meanwhile wins."""
        now = time.time() if now is None else now
        swept = []
        for raw, deadline in await self.redis.zrangebyscore(
            DEADLINES, "-inf", now, start=0, num=limit, withscores=True
        ):
            job_id = raw.decode()
            record = await self.get(job_id)
            if record is None or record.final:
                await self.redis.zrem(DEADLINES, job_id)
                continue
            queued = record.status == common_pb2.JOB_STATUS_QUEUED
            if not queued and now < deadline + abandon_after_s:
                continue  # its dispatcher is still expected to end it
            if await self.finish(job_id, await self._timed_out(record, now, queued)):
                swept.append((job_id, record.status))
        return swept

    async def _timed_out(self, record: JobRecord, now: float, queued: bool) -> common_pb2.InferenceResult:
        waited_ms = (now - record.submitted_at) * 1000
        result = common_pb2.InferenceResult(
            job_id=record.job_id,
            status=common_pb2.JOB_STATUS_TIMED_OUT,
            finish_reason=common_pb2.FINISH_REASON_TIMEOUT,
            timed_out=True,
            latency_ms=waited_ms,
        )
        if queued:
            result.error = f"timed out after {waited_ms:.0f} ms in the queue (no engine was free)"
        else:
            result.text = await self.text(record.job_id)
            # Only the first choice's text is kept outside the events: the others are lost here.
            result.choices.append(
                common_pb2.Choice(text=result.text, finish_reason=common_pb2.FINISH_REASON_TIMEOUT)
            )
            result.error = (
                f"timed out after {waited_ms:.0f} ms; no dispatcher ended it (its owner stopped), so "
                "it was swept with the output it had"
            )
        return result
