"""The job queue: one Redis stream per priority (9 first), read by the "dispatch" consumer group.

Each entry a dispatcher handles is held under a lease (`expert:jobs:lease:{stream}:{entry id}`, the
dispatcher's name with a TTL) that the dispatcher renews while the job runs. An entry is reclaimed
by another dispatcher only when its lease is gone, never for its idle time alone: a Redis outage
stops every renewal and lets every lease lapse, but the owners that are alive take theirs back
within a third of a lease once Redis answers, and a claimer waits a whole lease with Redis
answering before it takes an entry (`dispatch/reclaim.py`). Renewing and claiming are each one
script, so an entry has one holder at a time, and a holder that finds its lease taken stops.
"""

from __future__ import annotations

from redis.asyncio import Redis

from libs.redis_streams import ensure_group

GROUP = "dispatch"
DEAD_LETTER = "expert:jobs:dead"
PRIORITIES = range(9, -1, -1)  # most important first
LEASE_PREFIX = "expert:jobs:lease:"


def stream(priority: int) -> str:
    return f"expert:jobs:p{priority}"


def lease_key(stream_name: str, entry_id: str) -> str:
    return f"{LEASE_PREFIX}{stream_name}:{entry_id}"


STREAMS = [stream(p) for p in PRIORITIES]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# KEYS: the lease, the stream; ARGV: group, consumer, lease ms, entry id
# -> 1 if the lease is the consumer's (renewed, and the entry's idle time reset), 0 if another holds it
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[4], 'JUSTID')
return 1
"""

# KEYS: the lease, the stream; ARGV: group, consumer, lease ms, entry id
# -> the entry's fields (flat) if claimed, nothing when someone holds its lease or it is gone
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {} end
local claimed = redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[4])
if #claimed == 0 or not claimed[1][2] then return {} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return claimed[1][2]
"""

# KEYS: the lease; ARGV: consumer -> 1 if it was the consumer's and is gone now
_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class JobQueue:
    def __init__(self, redis: Redis, lease_ms: int = 15_000) -> None:
        self.redis = redis
        self.lease_ms = lease_ms  # how long a lease lasts unless renewed
        self._renew = redis.register_script(_RENEW)
        self._claim = redis.register_script(_CLAIM)
        self._let_go = redis.register_script(_LET_GO)

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
        reply = await self._renew(
            keys=[lease_key(stream_name, entry_id), stream_name],
            args=[GROUP, consumer, self.lease_ms, entry_id],
        )
        return reply == 1

    async def let_go(self, stream_name: str, entry_id: str, consumer: str) -> None:
        """Drop the consumer's lease on an entry it stops handling unfinished (a stop, Redis lost
        for longer than a job's writes wait), so another dispatcher may take it without waiting
        for the lease to lapse."""
        await self._let_go(keys=[lease_key(stream_name, entry_id)], args=[consumer])

    async def unleased(self, stream_name: str, min_idle_ms: int, count: int = 100) -> list[tuple[str, int]]:
        """The pending entries of the stream idle for `min_idle_ms` or more whose lease is gone, as
        (entry id, times delivered), oldest first."""
        pending = await self.redis.xpending_range(
            stream_name, GROUP, min="-", max="+", count=count, idle=min_idle_ms
        )
        if not pending:
            return []
        ids = [_text(p["message_id"]) for p in pending]
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.exists(lease_key(stream_name, entry_id))
            held = await pipe.execute()
        return [
            (entry_id, int(p["times_delivered"]))
            for entry_id, p, lease in zip(ids, pending, held, strict=True)
            if not lease
        ]

    async def claim(self, stream_name: str, entry_id: str, consumer: str) -> dict[str, bytes] | None:
        """Take the entry and its lease for the consumer, unless someone holds its lease (or the
        entry is gone); returns its fields."""
        flat = await self._claim(
            keys=[lease_key(stream_name, entry_id), stream_name],
            args=[GROUP, consumer, self.lease_ms, entry_id],
        )
        if not flat:
            return None
        return {_text(k): v for k, v in zip(flat[0::2], flat[1::2], strict=True)}

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
