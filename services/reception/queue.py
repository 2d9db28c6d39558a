"""The job queue: one Redis stream per priority (9 first), read by the "dispatch" consumer group."""

from __future__ import annotations

from redis.asyncio import Redis

from libs.redis_streams import ensure_group

GROUP = "dispatch"
DEAD_LETTER = "expert:jobs:dead"
PRIORITIES = range(9, -1, -1)  # most important first


def stream(priority: int) -> str:
    return f"expert:jobs:p{priority}"


STREAMS = [stream(p) for p in PRIORITIES]


class JobQueue:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def setup(self) -> None:
        for name in STREAMS:
            await ensure_group(self.redis, name, GROUP)

    async def done(self, stream_name: str, entry_id: str) -> None:
        """Acknowledge and delete a handled entry, so the streams hold only what is left to do
        (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream_name, GROUP, entry_id)
            pipe.xdel(stream_name, entry_id)
            await pipe.execute()

    async def keep(self, stream_name: str, entry_id: str, consumer: str) -> None:
        """Reset the entry's idle time while its job runs, so no other dispatcher reclaims it."""
        await self.redis.xclaim(stream_name, GROUP, consumer, 0, [entry_id], justid=True)

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
