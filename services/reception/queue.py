"""The job queue: one Redis stream per priority (9 first), read by the "dispatch" consumer group.

Each entry a dispatcher handles is held under a lease (`expert:jobs:lease:{stream}:{entry id}`, the
dispatcher's name with a TTL) that the dispatcher renews while the job runs. The leases, their
scripts and the rule for taking an entry over are libs/stream_lease.py's: an entry is reclaimed by
another dispatcher only when its lease is gone, never for its idle time alone; a Redis outage lets
every lease lapse, but the owners that are alive take theirs back within a third of a lease once
Redis answers, and a claimer waits a whole lease with Redis answering before it takes an entry
(`dispatch/reclaim.py`). A holder that finds its lease taken stops.
"""

from __future__ import annotations

from redis.asyncio import Redis

from libs.redis_streams import ensure_group
from libs.stream_lease import LeaseNaming, StreamLeases

GROUP = "dispatch"
DEAD_LETTER = "expert:jobs:dead"
PRIORITIES = range(9, -1, -1)  # most important first
LEASE_PREFIX = "expert:jobs:lease:"
LEASES = LeaseNaming(LEASE_PREFIX)  # one lease per entry


def stream(priority: int) -> str:
    return f"expert:jobs:p{priority}"


def lease_key(stream_name: str, entry_id: str) -> str:
    return f"{LEASE_PREFIX}{stream_name}:{entry_id}"  # as LEASES names it


STREAMS = [stream(p) for p in PRIORITIES]


class JobQueue:
    def __init__(self, redis: Redis, lease_ms: int = 15_000) -> None:
        self.redis = redis
        self.lease_ms = lease_ms  # how long a lease lasts unless renewed
        self.leases = StreamLeases(redis, GROUP, LEASES, lease_ms)

    async def setup(self) -> None:
        for name in STREAMS:
            await ensure_group(self.redis, name, GROUP)

    async def done(self, stream_name: str, entry_id: str) -> None:
        """Acknowledge and delete a handled entry, and its lease, so the streams hold only what is
        left to do (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream_name, GROUP, entry_id)
            pipe.xdel(stream_name, entry_id)
            pipe.delete(lease_key(stream_name, entry_id))
            await pipe.execute()

    async def renew(self, stream_name: str, entry_id: str, consumer: str) -> bool:
        """Take or extend the consumer's lease on the entry while its job runs; False when another
        dispatcher holds it (it reclaimed the entry while this one could not renew)."""
        return await self.leases.renew(lease_key(stream_name, entry_id), stream_name, entry_id, consumer)

    async def let_go(self, stream_name: str, entry_id: str, consumer: str) -> None:
        """Drop the consumer's lease on an entry it stops handling unfinished (a stop, Redis lost
        for longer than a job's writes wait), so another dispatcher may take it without waiting
        for the lease to lapse."""
        await self.leases.let_go(lease_key(stream_name, entry_id), consumer)

    async def claim(self, stream_name: str, entry_id: str, consumer: str) -> dict[str, bytes] | None:
        """Take the entry and its lease for the consumer, unless someone holds its lease (or the
        entry is gone); returns its fields."""
        return await self.leases.claim(lease_key(stream_name, entry_id), stream_name, entry_id, consumer)

    async def depths(self) -> dict[int, int]:
        """Entries not yet handed to a dispatcher, by priority (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in PRIORITIES:
                pipe.xinfo_groups(stream(p))
            # A stream that is missing (Redis restarted without its data) holds nothing.
            replies = await pipe.execute(raise_on_error=False)
        return {
            p: 0
            if isinstance(groups, Exception)
            else sum(int(g.get("lag") or 0) for g in groups if g["name"] in (GROUP, GROUP.encode()))
            for p, groups in zip(PRIORITIES, replies, strict=True)
        }

    async def depth_at_or_above(self, priority: int) -> int:
        """Entries not yet handed to a dispatcher, at this priority or higher."""
        return sum(depth for p, depth in (await self.depths()).items() if p >= priority)
