"""Training jobs in Redis: each job's record, its events, and who may see it.

A job is one hash, `expert:training:job:{id}`: owner, status, spec (JSON), times, metrics (JSON),
checkpoints (JSON list), the expert it produced (JSON), error, and two requests the trainer reads
between steps (`cancel_requested`, `checkpoint_requested`). The owner's jobs are a sorted set by
creation time (`expert:training:jobs:{owner}`). A job's events are a stream
(`expert:training:job:{id}:events`, capped). A live job never expires; once it ends, its record and
its events expire after the retention (libs/training/retention.py), set by the same script that
ends it, and a resume takes that expiry away again. An event for a job whose record is gone is not
written (it would be a stream nobody reads, without a TTL). Only its owner sees a job; anyone else
gets None, as for a job that does not exist.

Only JSON is stored (libs/training/job_json.py): a spec JSON cannot write is refused (the admission
checked it first), a number the trainer reports that JSON cannot write (a diverged loss is NaN) is
stored as null, and a record written before that rule held reads leniently, so one bad record never
fails a listing of its owner's jobs.

Status changes are compare-and-set scripts, so reception (cancel, resume) and the trainer (start,
checkpoint, finish) never overwrite each other: PENDING -> RUNNING <-> CHECKPOINTING -> COMPLETED,
FAILED or CANCELLED; a cancelled or failed job can be resumed (back to PENDING). Reception creates a
job and its queue entry in one transaction (libs.training.queue).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from libs.training.job_json import as_object, read_json, to_json
from libs.training.queue import QUEUE_STREAM
from libs.training.retention import DEFAULT_RETENTION_S

JOB_PREFIX = "expert:training:job:"
OWNER_PREFIX = "expert:training:jobs:"
ID_PREFIX = "ftjob-"
EVENTS_MAXLEN = 10_000

PENDING, RUNNING, CHECKPOINTING = "PENDING", "RUNNING", "CHECKPOINTING"
COMPLETED, FAILED, CANCELLED = "COMPLETED", "FAILED", "CANCELLED"
STATUSES = (PENDING, RUNNING, CHECKPOINTING, COMPLETED, FAILED, CANCELLED)
FINAL = (COMPLETED, FAILED, CANCELLED)
ACTIVE = (RUNNING, CHECKPOINTING)
_JSON_FIELDS = ("spec", "metrics", "checkpoints", "expert")

# A job's keys (KEYS[1] its record, KEYS[2] its events) expire `retention` ms after it ends, and
# never while it lives (a resume takes the expiry away).
_KEEP = (
    "local FINAL = {"
    + ", ".join(f"['{status}'] = true" for status in FINAL)
    + """}
local function keep(status, retention)
  for i = 1, 2 do
    if FINAL[status] then redis.call('PEXPIRE', KEYS[i], retention) else redis.call('PERSIST', KEYS[i]) end
  end
end
"""
)

# KEYS: the job, its events; ARGV: new status, retention ms, how many allowed statuses, the allowed
# statuses, then field/value pairs to set with it -> 1 when changed, else the current status
# (false: no such job)
_TRANSITION = (
    _KEEP
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
local allowed = tonumber(ARGV[3])
for i = 4, 3 + allowed do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
    for j = 4 + allowed, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
    keep(ARGV[1], ARGV[2])
    return 1
  end
end
return status
"""
)

# KEYS: the job, its events; ARGV: now, retention ms -> the status after: a pending job is
# cancelled at once, a running one is asked to stop (the trainer cancels it within a step), a final
# one is left as it is
_CANCEL = (
    _KEEP
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'PENDING' then
  redis.call('HSET', KEYS[1], 'status', 'CANCELLED', 'updated_at', ARGV[1], 'finished_at', ARGV[1])
  keep('CANCELLED', ARGV[2])
  return 'CANCELLED'
end
if status == 'RUNNING' or status == 'CHECKPOINTING' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1', 'updated_at', ARGV[1])
end
return status
"""
)

# KEYS: the job, its events; ARGV: the events' cap, then the event's field/value pairs -> 1 when
# written: only while the job's record exists, and then expiring with it
_EVENT = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 2))
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
"""


def job_key(job_id: str) -> str:
    return JOB_PREFIX + job_id


def events_key(job_id: str) -> str:
    return f"{JOB_PREFIX}{job_id}:events"


def new_job_id() -> str:
    return ID_PREFIX + secrets.token_hex(12)


def new_checkpoint_id() -> str:
    return "ckpt-" + secrets.token_hex(8)


@dataclass
class TrainingJob:
    job_id: str
    owner: str
    status: str
    spec: dict[str, Any]
    created_at: float
    updated_at: float
    started_at: float | None = None
    finished_at: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    expert: dict[str, Any] | None = None
    error: str = ""
    cancel_requested: bool = False
    checkpoint_request: str = ""  # the id of the checkpoint asked for, "" when none is
    resume_from: str = ""  # a checkpoint id asked for by `resume`; "" for the last one

    @classmethod
    def from_hash(cls, job_id: str, raw: dict[bytes, bytes]) -> TrainingJob:
        text = {k.decode(): v.decode() for k, v in raw.items()}
        loaded = {name: read_json(text[name]) for name in _JSON_FIELDS if text.get(name)}

        def when(name: str) -> float | None:
            return float(text[name]) if text.get(name) else None

        return cls(
            job_id=job_id,
            owner=text["owner"],
            status=text["status"],
            spec=as_object(loaded.get("spec")) or {},
            created_at=float(text["created_at"]),
            updated_at=float(text["updated_at"]),
            started_at=when("started_at"),
            finished_at=when("finished_at"),
            metrics=as_object(loaded.get("metrics")) or {},
            checkpoints=[c for c in loaded.get("checkpoints") or [] if as_object(c)],
            expert=as_object(loaded.get("expert")),
            error=text.get("error", ""),
            cancel_requested=text.get("cancel_requested") == "1",
            checkpoint_request=text.get("checkpoint_requested", ""),
            resume_from=text.get("resume_from", ""),
        )

    @property
    def checkpoint_requested(self) -> bool:
        return bool(self.checkpoint_request)

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def public_checkpoints(self) -> list[dict[str, Any]]:
        """The checkpoints as the API shows them (without where they lie on the trainer's disk)."""
        return [{k: v for k, v in c.items() if k != "path"} for c in self.checkpoints]

    def to_dict(self) -> dict[str, Any]:
        """The job as both APIs show it."""
        return {
            "id": self.job_id,
            "status": self.status,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "spec": self.spec,
            "metrics": self.metrics,
            "checkpoints": self.public_checkpoints(),
            "expert": self.expert,
            "error": self.error or None,
            "cancel_requested": self.cancel_requested,
        }


class TrainingJobs:
    """The training jobs of a Redis (decode_responses=False)."""

    def __init__(self, redis: Redis, retention_s: float = DEFAULT_RETENTION_S) -> None:
        self.redis = redis
        self.retention_ms = int(retention_s * 1000)  # how long an ended job is kept
        self._transition = redis.register_script(_TRANSITION)
        self._cancel = redis.register_script(_CANCEL)
        self._event = redis.register_script(_EVENT)

    async def create(self, owner: str, spec: dict[str, Any]) -> TrainingJob:
        """A new PENDING job of `owner`, queued for the trainer (one transaction)."""
        now = time.time()
        job = TrainingJob(new_job_id(), owner, PENDING, spec, now, now)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                job_key(job.job_id),
                mapping={
                    "owner": owner,
                    "status": PENDING,
                    "spec": json.dumps(spec, allow_nan=False),  # parse_spec's: finite
                    "created_at": repr(now),
                    "updated_at": repr(now),
                },
            )
            pipe.zadd(OWNER_PREFIX + owner, {job.job_id: now})
            pipe.xadd(events_key(job.job_id), _event_fields("status", "job queued", {"status": PENDING}))
            pipe.xadd(QUEUE_STREAM, {"job_id": job.job_id})
            await pipe.execute()
        return job

    async def get(self, job_id: str, owner: str | None = None) -> TrainingJob | None:
        """The job; None when there is none, or (with `owner`) when it is someone else's."""
        raw = await self.redis.hgetall(job_key(job_id))
        if not raw or b"status" not in raw:
            return None
        job = TrainingJob.from_hash(job_id, raw)
        return None if owner is not None and job.owner != owner else job

    async def list(self, owner: str, limit: int = 20, after: str = "") -> list[TrainingJob]:
        """`owner`'s jobs, newest first, `limit` of them after the job `after` (a page)."""
        ids = [i.decode() for i in await self.redis.zrevrange(OWNER_PREFIX + owner, 0, -1)]
        if after:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        jobs, expired = [], []
        for job_id in ids:
            job = await self.get(job_id, owner)
            if job is not None:
                jobs.append(job)
            elif not await self.redis.exists(job_key(job_id)):
                expired.append(job_id)  # past its retention: the owner's index lets it go too
            if len(jobs) == limit:
                break
        if expired:
            await self.redis.zrem(OWNER_PREFIX + owner, *expired)
        return jobs

    async def transition(self, job_id: str, allowed: tuple[str, ...], to: str, **fields: Any) -> bool:
        """Moves the job to status `to` (setting `fields`, JSON for dicts and lists) if its status
        is one of `allowed`; whether it did."""
        pairs: list[Any] = ["updated_at", repr(time.time())]
        for name, value in fields.items():
            pairs += [name, _stored(value)]
        reply = await self._transition(
            keys=[job_key(job_id), events_key(job_id)],
            args=[to, self.retention_ms, len(allowed), *allowed, *pairs],
        )
        return reply == 1

    async def update(self, job_id: str, **fields: Any) -> None:
        """Sets fields that are not the status (metrics, checkpoints, requests)."""
        mapping = {name: _stored(value) for name, value in fields.items()}
        await self.redis.hset(job_key(job_id), mapping={**mapping, "updated_at": repr(time.time())})

    async def cancel(self, job_id: str) -> str | None:
        """Cancels a pending job, asks a running one to stop; its status after (None: no job)."""
        reply = await self._cancel(
            keys=[job_key(job_id), events_key(job_id)], args=[repr(time.time()), self.retention_ms]
        )
        return reply.decode() if isinstance(reply, bytes) else None

    async def request_checkpoint(self, job_id: str) -> str | None:
        """Asks the trainer for a checkpoint after the current step; the id it will have, None unless
        the job runs. A request not yet served is answered with its id (one checkpoint serves both)."""
        job = await self.get(job_id)
        if job is None or job.status not in ACTIVE:
            return None
        if job.checkpoint_requested:
            return job.checkpoint_request
        checkpoint_id = new_checkpoint_id()
        await self.update(job_id, checkpoint_requested=checkpoint_id)
        return checkpoint_id

    async def resume(self, job_id: str, checkpoint_id: str) -> bool:
        """Queues a cancelled or failed job again, to go on from `checkpoint_id` ("" the last one)."""
        changed = await self.transition(
            job_id,
            (CANCELLED, FAILED),
            PENDING,
            cancel_requested="0",
            checkpoint_requested="",
            resume_from=checkpoint_id,
            error="",
            finished_at="",
        )
        if changed:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xadd(events_key(job_id), _event_fields("status", "job resumed", {"status": PENDING}))
                pipe.xadd(QUEUE_STREAM, {"job_id": job_id})
                await pipe.execute()
        return changed

    async def report_step(self, job_id: str, metrics: dict[str, Any]) -> tuple[bool, str]:
        """Records a step's metrics and its progress event; returns what was asked of the trainer
        meanwhile: (cancel requested, the id of a checkpoint asked for or ""). One round trip."""
        message = f"step {metrics['step']}/{metrics['total_steps']}: train loss {metrics['train_loss']:.4f}"
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(job_key(job_id), mapping={"metrics": to_json(metrics), "updated_at": repr(time.time())})
            pipe.xadd(
                events_key(job_id),
                _event_fields("progress", message, metrics),
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.hmget(job_key(job_id), ["cancel_requested", "checkpoint_requested"])
            *_, (cancel, checkpoint) = await pipe.execute()
        return cancel == b"1", (checkpoint or b"").decode()

    async def event(self, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None) -> bool:
        """Adds an event to the job's stream (expiring with its record); False when the job is gone."""
        pairs = [part for item in _event_fields(kind, message, data or {}).items() for part in item]
        written = await self._event(keys=[job_key(job_id), events_key(job_id)], args=[EVENTS_MAXLEN, *pairs])
        return written == 1

    async def events(
        self, job_id: str, after: str = "", limit: int = 100, newest_first: bool = False
    ) -> list[dict[str, Any]]:
        """The job's events, oldest first, `limit` of them after event id `after`; with
        `newest_first` (OpenAI's order) newest first, `after` then being the last of the page before."""
        if newest_first:
            end = f"({after}" if after else "+"
            entries = await self.redis.xrevrange(events_key(job_id), max=end, min="-", count=limit)
            return [_event(entry_id, fields) for entry_id, fields in entries]
        start = f"({after}" if after else "-"
        entries = await self.redis.xrange(events_key(job_id), min=start, max="+", count=limit)
        return [_event(entry_id, fields) for entry_id, fields in entries]


def _stored(value: Any) -> str:
    if isinstance(value, dict | list):
        return to_json(value)
    return value if isinstance(value, str) else repr(value)


def _event_fields(kind: str, message: str, data: dict[str, Any]) -> dict[str, str]:
    return {"type": kind, "message": message, "data": to_json(data), "created_at": repr(time.time())}


def _event(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
    return {
        "id": entry_id.decode(),
        "type": fields[b"type"].decode(),
        "message": fields[b"message"].decode(),
        "data": as_object(read_json(fields[b"data"].decode())) or {},
        "created_at": float(fields[b"created_at"]),
    }
