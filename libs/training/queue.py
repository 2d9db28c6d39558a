"""The training queue: one Redis stream (`expert:training:queue`) of job ids, read by the trainers'
consumer group, with at-least-once delivery.

A trainer that takes an entry holds its job's lease (`expert:training:lease:{job id}`: the
trainer's name with a TTL) and renews it while it trains; renewing also resets the entry's idle
time. The leases and the rule for taking an entry over are libs/stream_lease.py's, as for
reception's job queue: an entry whose job's lease has stayed gone for a whole lease while this
trainer kept looking (its trainer died, or hangs) is claimed, and the job resumed from its last
checkpoint; a Redis outage, which lets every lease lapse, takes no job from a living trainer,
which renews within a third of a lease once Redis answers. A job has one trainer at a time, and a
trainer that finds its lease taken stops. An entry for a job another trainer holds (a job queued
twice by a resume) is dropped. Entries are acknowledged and deleted once their job is final (or
handed back).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio import Redis

from libs.redis_streams import Entry, dead_letter, ensure_group, read_next
from libs.stream_lease import LeaseNaming, OrphanGuard, StreamLeases

QUEUE_STREAM = "expert:training:queue"
GROUP = "trainers"
DEAD_LETTER = "expert:training:dead"
LEASE_PREFIX = "expert:training:lease:"
LEASES = LeaseNaming(LEASE_PREFIX, field="job_id")  # one lease per job, whatever its entries


def lease_key(job_id: str) -> str:
    return LEASE_PREFIX + job_id


class TrainingQueue:
    def __init__(
        self, redis: Redis, consumer: str, lease_ms: int = 30_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.redis = redis
        self.consumer = consumer
        self.lease_ms = lease_ms
        self.leases = StreamLeases(redis, GROUP, LEASES, lease_ms)
        self.guard = OrphanGuard(self.leases, [QUEUE_STREAM], consumer, clock)

    async def setup(self) -> None:
        await ensure_group(self.redis, QUEUE_STREAM, GROUP)

    async def next(self, block_ms: int) -> Entry | None:
        """A new entry, waiting up to `block_ms`; None when none came."""
        return await read_next(self.redis, [QUEUE_STREAM], GROUP, self.consumer, block_ms=block_ms)

    async def hold(self, entry: Entry) -> bool:
        """Take or renew the lease of the entry's job; False when another trainer holds it."""
        return await self.leases.renew(lease_key(job_id_of(entry)), QUEUE_STREAM, entry.id, self.consumer)

    async def orphans(self) -> list[Entry]:
        """Claim the entries whose job's lease has stayed gone for a whole lease while this trainer
        looked (at least once a lease: a longer pause starts the wait over); called between jobs,
        so none of them is this trainer's own."""
        return await self.guard.orphans()

    async def done(self, entry: Entry) -> None:
        """Acknowledge and delete an entry, and drop its job's lease if it is this trainer's."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(QUEUE_STREAM, GROUP, entry.id)
            pipe.xdel(QUEUE_STREAM, entry.id)
            await pipe.execute()
        await self.let_go(entry)

    async def let_go(self, entry: Entry) -> None:
        """Drop this trainer's lease of the entry's job (stopping unfinished), so another trainer may
        take the entry once it has been unleased a whole lease."""
        await self.leases.let_go(lease_key(job_id_of(entry)), self.consumer)

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        await dead_letter(self.redis, entry, GROUP, DEAD_LETTER, delivered=entry.deliveries, reason=reason)
        await self.redis.xdel(QUEUE_STREAM, entry.id)


def job_id_of(entry: Entry) -> str:
    return entry.fields.get("job_id", b"").decode()
