"""Compacting Redis's append-only file after jobs' texts left Redis (EXPERT_STORE_REQUEST_TEXT=false).

Deleting a key does not take its bytes off disk: the append-only file (AOF) keeps every write,
the prompt and the output of an ended job included, until Redis rewrites it. So when a job ends
with its texts removed, `JobStore.finish` notes the job in PENDING, scored with the time its last
stream holding the texts expires. Every reception replica runs `Compactor.run`: once some noted
job is due, one replica (a lock key, set for `interval_s`) makes Redis delete the job's expired
streams (an access expires a key at once, rather than in Redis's background expiry cycle) and asks
for `BGREWRITEAOF`; the rewritten file holds only the live data. So an ended job's texts are off
disk within its streams' expiry + `interval_s` + the rewrite time (docs/operations.md).

A Redis without an AOF has nothing to compact (the notes are dropped). A Redis that refuses the
command (an ACL, a command renamed on a managed Redis) is logged once as a WARNING and counted
(`outcome` "refused"); jobs never fail for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.logging import get_logger

log = get_logger(__name__)

# Ended jobs whose texts are still in the AOF, scored by when their streams expire (a sorted set).
PENDING = "expert:persistence:pending"
# Held by the replica that compacts, for the interval: at most one rewrite per interval in all.
LOCK = "expert:persistence:compact-lock"
DEFAULT_INTERVAL_S = 60.0
# How often a replica looks for due jobs: the bound is the interval plus at most this.
CHECK_EVERY_S = 1.0
# The keys of a job that may still hold its texts after it ended (jobs.py).
_STREAM_SUFFIXES = (":events", ":result", ":text")
_JOB_PREFIX = "expert:job:"


class Compactor:
    def __init__(
        self,
        redis: Redis,
        interval_s: float = DEFAULT_INTERVAL_S,
        on_outcome: Callable[[str], None] | None = None,
        check_every_s: float = CHECK_EVERY_S,
    ) -> None:
        self.redis = redis
        self.interval_s = interval_s
        self.check_every_s = min(check_every_s, interval_s)
        # Told each attempt's outcome: "rewritten", "no_aof" or "refused" (the metric).
        self.on_outcome = on_outcome or (lambda outcome: None)
        self._warned = False

    async def run(self) -> None:
        """Compact whenever ended jobs are due, until cancelled; a Redis outage only delays it."""
        while True:
            try:
                await self.compact_due()
            except (RedisConnectionError, RedisTimeoutError) as error:
                log.debug("persistence compaction waits for Redis", error=str(error))
            await asyncio.sleep(self.check_every_s)

    async def compact_due(self) -> str | None:
        """One look: the outcome if this replica compacted (or found nothing to compact), None when
        no job is due, another replica compacted within the interval, or a rewrite is running."""
        now = time.time()
        due = await self.redis.zrangebyscore(PENDING, "-inf", now)
        if not due:
            return None
        persistence = await self._persistence()
        if persistence is not None and persistence.get("aof_rewrite_in_progress") == 1:
            return None  # its snapshot may predate these deletions: the next one will not
        if not await self.redis.set(LOCK, b"1", nx=True, px=int(self.interval_s * 1000)):
            return None
        outcome = await self._compact(due, persistence)
        if outcome is None:
            await self.redis.delete(LOCK)  # try again at the next look
            return None
        await self.redis.zremrangebyscore(PENDING, "-inf", now)
        self.on_outcome(outcome)
        return outcome

    async def _compact(self, due: list[bytes], persistence: dict | None) -> str | None:
        """The outcome, or None when a rewrite that Redis started by itself got in first (its
        snapshot may predate the deletions)."""
        if persistence is None:
            return "refused"
        if persistence.get("aof_enabled") != 1:
            return "no_aof"
        # Touching an expired key deletes it now (and writes the DEL to the AOF); the background
        # expiry cycle might reach it only after the rewrite's snapshot.
        keys = [_JOB_PREFIX + job.decode() + suffix for job in due for suffix in _STREAM_SUFFIXES]
        for start in range(0, len(keys), 512):
            await self.redis.exists(*keys[start : start + 512])
        try:
            await self.redis.bgrewriteaof()
        except ResponseError as error:
            if "already in progress" in str(error):
                return None
            self._warn(error)
            return "refused"
        return "rewritten"

    async def _persistence(self) -> dict | None:
        """INFO persistence, or None when Redis refuses it."""
        try:
            return await self.redis.info("persistence")
        except ResponseError as error:
            self._warn(error)
            return None

    def _warn(self, error: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "Redis refused the append-only file rewrite: ended jobs' texts stay on its disk "
                "until Redis rewrites the file by itself",
                error=str(error),
            )
