"""Queue entries held under leases (services/reception/queue.py, dispatch/reclaim.py) on a real
Redis: a dispatcher takes over an entry only when its holder's lease has stayed gone for a whole
lease while Redis answered, never for its idle time alone, never one of its own; a holder whose
lease was taken learns it at its next renewal."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from libs.redis_streams import read_next
from services.reception.dispatch.reclaim import Reclaimer
from services.reception.queue import GROUP, STREAMS, JobQueue, lease_key, stream
from tests.helpers.clock import ManualClock

LEASE_MS = 200


def _run(redis_url: str, scenario) -> None:
    async def main():
        redis = Redis.from_url(redis_url)
        try:
            queue = JobQueue(redis, lease_ms=LEASE_MS)
            await queue.setup()
            await redis.xadd(stream(5), {"job_id": "job-1"})
            entry = await read_next(redis, STREAMS, GROUP, "owner", block_ms=0)
            assert await queue.renew(entry.stream, entry.id, "owner")
            await scenario(redis, queue, entry)
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_an_entry_whose_lease_lapsed_is_taken_only_after_a_whole_lease_without_it(clean_redis_url):
    async def scenario(redis, queue, entry):
        clock = ManualClock(1000.0)
        other = Reclaimer(queue, "other", clock=clock)
        await asyncio.sleep(2 * LEASE_MS / 1000)  # the owner stopped renewing: the lease lapsed
        assert await other.orphans(set()) == []  # first seen gone: a suspicion
        clock.now += LEASE_MS / 1000 / 2
        assert await other.orphans(set()) == []
        clock.now += LEASE_MS / 1000 / 2
        (taken,) = await other.orphans(set())
        assert (taken.id, taken.fields["job_id"], taken.deliveries) == (entry.id, b"job-1", 2)
        assert await redis.get(lease_key(entry.stream, entry.id)) == b"other"
        # the old holder learns it lost the entry at its next renewal, and its let-go is a no-op
        assert not await queue.renew(entry.stream, entry.id, "owner")
        await queue.let_go(entry.stream, entry.id, "owner")
        assert await redis.get(lease_key(entry.stream, entry.id)) == b"other"

    _run(clean_redis_url, scenario)


def test_a_holder_that_renews_after_an_outage_keeps_its_entry(clean_redis_url):
    """The lease lapsed (Redis was down longer than a lease); the live holder renews within the
    lease that a claimer waits once Redis answers, and the entry stays its own."""

    async def scenario(redis, queue, entry):
        clock = ManualClock(1000.0)
        other = Reclaimer(queue, "other", clock=clock)
        await asyncio.sleep(2 * LEASE_MS / 1000)
        assert await other.orphans(set()) == []  # seen gone
        assert await queue.renew(entry.stream, entry.id, "owner")  # the holder is back
        clock.now += 10 * LEASE_MS / 1000
        assert await other.orphans(set()) == []
        assert await redis.get(lease_key(entry.stream, entry.id)) == b"owner"

    _run(clean_redis_url, scenario)


def test_a_failed_look_forgets_what_was_seen(clean_redis_url):
    """A look that fails (Redis unreachable) may be an outage the holders could not renew through:
    the wait for a whole lease starts over."""

    async def scenario(redis, queue, entry):
        clock = ManualClock(1000.0)
        other = Reclaimer(queue, "other", clock=clock)
        await asyncio.sleep(2 * LEASE_MS / 1000)
        assert await other.orphans(set()) == []
        clock.now += 10 * LEASE_MS / 1000
        other.forget()  # what orphans() does when a look raises
        assert await other.orphans(set()) == []
        clock.now += LEASE_MS / 1000
        assert [e.id for e in await other.orphans(set())] == [entry.id]

    _run(clean_redis_url, scenario)


def test_a_dispatcher_never_takes_its_own_running_entry(clean_redis_url):
    async def scenario(redis, queue, entry):
        clock = ManualClock(1000.0)
        owner = Reclaimer(queue, "owner", clock=clock)
        await asyncio.sleep(2 * LEASE_MS / 1000)
        own = {(entry.stream, entry.id)}
        assert await owner.orphans(own) == []
        clock.now += 10 * LEASE_MS / 1000
        assert await owner.orphans(own) == []

    _run(clean_redis_url, scenario)


def test_a_released_entry_is_acknowledged_with_its_lease(clean_redis_url):
    async def scenario(redis, queue, entry):
        await queue.done(entry.stream, entry.id)
        assert not await redis.exists(lease_key(entry.stream, entry.id))
        assert await redis.xpending(entry.stream, GROUP) == {
            "pending": 0,
            "min": None,
            "max": None,
            "consumers": [],
        }

    _run(clean_redis_url, scenario)
