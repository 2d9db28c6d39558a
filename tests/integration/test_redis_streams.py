"""libs.redis_streams against a real redis-server: priority reads, blocking, reclaiming an idle entry
from a dead consumer, dead-lettering after too many deliveries, acknowledgement, trimming."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from libs.redis_streams import Entry, ack, add, add_many, ensure_group, read_next, reclaim

HIGH, NORMAL, LOW = "jobs:high", "jobs:normal", "jobs:low"
STREAMS = [HIGH, NORMAL, LOW]
GROUP = "dispatch"
DEAD = "jobs:dead"


def run_with_redis(url: str, scenario) -> None:
    """Runs `scenario(redis)` with a client and the group on the three streams."""

    async def main():
        redis = Redis.from_url(url, decode_responses=False)
        try:
            for stream in STREAMS:
                await ensure_group(redis, stream, GROUP)
            await scenario(redis)
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_ensure_group_is_idempotent_and_creates_the_stream(clean_redis_url):
    async def scenario(redis):
        await ensure_group(redis, HIGH, GROUP)
        groups = await redis.xinfo_groups(HIGH)
        assert [group["name"] for group in groups] == [GROUP.encode()]

    run_with_redis(clean_redis_url, scenario)


def test_entries_added_before_the_group_existed_are_delivered(clean_redis_url):
    async def scenario(redis):
        await add(redis, "early", {"job_id": "j-0"})
        await ensure_group(redis, "early", GROUP)
        entry = await read_next(redis, ["early"], GROUP, "c1", block_ms=0)
        assert entry is not None and entry.fields == {"job_id": b"j-0"}

    run_with_redis(clean_redis_url, scenario)


def test_read_next_takes_the_highest_priority_stream_first_and_oldest_within_it(clean_redis_url):
    async def scenario(redis):
        await add(redis, LOW, {"job_id": "low-1"})
        await add(redis, NORMAL, {"job_id": "normal-1"})
        await add(redis, HIGH, {"job_id": "high-1"})
        await add(redis, HIGH, {"job_id": "high-2", "n": 3})
        order = []
        while (entry := await read_next(redis, STREAMS, GROUP, "c1", block_ms=0)) is not None:
            order.append((entry.stream, entry.fields["job_id"].decode(), entry.deliveries))
        assert order == [
            (HIGH, "high-1", 1),
            (HIGH, "high-2", 1),
            (NORMAL, "normal-1", 1),
            (LOW, "low-1", 1),
        ]

    run_with_redis(clean_redis_url, scenario)


def test_read_next_returns_none_after_blocking_on_empty_streams(clean_redis_url):
    async def scenario(redis):
        start = time.monotonic()
        assert await read_next(redis, STREAMS, GROUP, "c1", block_ms=200) is None
        assert 0.15 < time.monotonic() - start < 1.0

    run_with_redis(clean_redis_url, scenario)


def test_a_blocked_read_wakes_for_a_new_entry_and_still_prefers_priority(clean_redis_url):
    async def scenario(redis):
        waiting = asyncio.create_task(read_next(redis, STREAMS, GROUP, "c1", block_ms=5000))
        await asyncio.sleep(0.1)
        # Both land while the reader blocks; the high-priority one must be the one it takes.
        async with redis.pipeline(transaction=True) as pipe:
            pipe.xadd(LOW, {"job_id": "low"})
            pipe.xadd(HIGH, {"job_id": "high"})
            await pipe.execute()
        start = time.monotonic()
        entry = await asyncio.wait_for(waiting, 5)
        assert time.monotonic() - start < 1.0
        assert (entry.stream, entry.fields["job_id"]) == (HIGH, b"high")
        # The low-priority entry was not taken by the wait: it is still new for the group.
        other = await read_next(redis, STREAMS, GROUP, "c2", block_ms=0)
        assert (other.stream, other.fields["job_id"]) == (LOW, b"low")

    run_with_redis(clean_redis_url, scenario)


def test_each_entry_goes_to_one_consumer_of_the_group(clean_redis_url):
    async def scenario(redis):
        for i in range(6):
            await add(redis, NORMAL, {"job_id": f"j-{i}"})
        readers = [read_next(redis, STREAMS, GROUP, f"c{i % 3}", block_ms=0) for i in range(6)]
        entries = await asyncio.gather(*readers)
        assert sorted(e.fields["job_id"] for e in entries) == [f"j-{i}".encode() for i in range(6)]

    run_with_redis(clean_redis_url, scenario)


def test_an_acknowledged_entry_is_not_pending_and_not_reclaimed(clean_redis_url):
    async def scenario(redis):
        entry_id = await add(redis, HIGH, {"job_id": "j-1"})
        entry = await read_next(redis, STREAMS, GROUP, "c1", block_ms=0)
        assert entry.id == entry_id
        assert await ack(redis, HIGH, GROUP, entry.id) is True
        assert await ack(redis, HIGH, GROUP, entry.id) is False
        assert (await redis.xpending(HIGH, GROUP))["pending"] == 0
        await asyncio.sleep(0.05)
        assert (
            await reclaim(redis, HIGH, GROUP, "c2", min_idle_ms=10, max_deliveries=3, dead_letter_stream=DEAD)
            == []
        )

    run_with_redis(clean_redis_url, scenario)


def test_an_idle_entry_is_reclaimed_by_another_consumer(clean_redis_url):
    async def scenario(redis):
        await add(redis, HIGH, {"job_id": "j-1"})
        taken = await read_next(redis, STREAMS, GROUP, "dead-consumer", block_ms=0)
        # Not idle long enough yet: it stays with the consumer that has it.
        assert (
            await reclaim(
                redis, HIGH, GROUP, "c2", min_idle_ms=60_000, max_deliveries=3, dead_letter_stream=DEAD
            )
            == []
        )
        await asyncio.sleep(0.15)
        (entry,) = await reclaim(
            redis, HIGH, GROUP, "c2", min_idle_ms=100, max_deliveries=3, dead_letter_stream=DEAD
        )
        assert entry == Entry(stream=HIGH, id=taken.id, fields={"job_id": b"j-1"}, deliveries=2)
        (pending,) = await redis.xpending_range(HIGH, GROUP, "-", "+", 10)
        assert pending["consumer"] == b"c2"
        # Claimed just now, so not idle: a second reclaimer gets nothing.
        assert (
            await reclaim(
                redis, HIGH, GROUP, "c3", min_idle_ms=100, max_deliveries=3, dead_letter_stream=DEAD
            )
            == []
        )

    run_with_redis(clean_redis_url, scenario)


def test_an_entry_delivered_max_deliveries_times_goes_to_the_dead_letter_stream(clean_redis_url):
    async def scenario(redis):
        await add(redis, HIGH, {"job_id": "poison", "payload": b"\xff\x00"})
        first = await read_next(redis, STREAMS, GROUP, "c0", block_ms=0)
        deliveries = [first.deliveries]
        for consumer in ("c1", "c2"):
            await asyncio.sleep(0.08)
            (entry,) = await reclaim(
                redis, HIGH, GROUP, consumer, min_idle_ms=50, max_deliveries=3, dead_letter_stream=DEAD
            )
            deliveries.append(entry.deliveries)
        assert deliveries == [1, 2, 3]
        await asyncio.sleep(0.08)
        assert (
            await reclaim(redis, HIGH, GROUP, "c3", min_idle_ms=50, max_deliveries=3, dead_letter_stream=DEAD)
            == []
        )
        assert (await redis.xpending(HIGH, GROUP))["pending"] == 0
        ((_dead_id, fields),) = await redis.xrange(DEAD)
        assert fields == {
            b"job_id": b"poison",
            b"payload": b"\xff\x00",
            b"source_stream": HIGH.encode(),
            b"source_id": first.id.encode(),
            b"deliveries": b"3",
        }

    run_with_redis(clean_redis_url, scenario)


def test_reclaim_returns_at_most_count_entries_oldest_first(clean_redis_url):
    async def scenario(redis):
        ids = [await add(redis, LOW, {"n": i}) for i in range(5)]
        for _ in ids:
            await read_next(redis, [LOW], GROUP, "gone", block_ms=0)
        await asyncio.sleep(0.08)
        first = await reclaim(
            redis, LOW, GROUP, "c1", min_idle_ms=50, max_deliveries=3, dead_letter_stream=DEAD, count=3
        )
        rest = await reclaim(
            redis, LOW, GROUP, "c1", min_idle_ms=50, max_deliveries=3, dead_letter_stream=DEAD, count=3
        )
        assert [e.id for e in first] == ids[:3]
        assert [e.id for e in rest] == ids[3:]

    run_with_redis(clean_redis_url, scenario)


def test_add_trims_approximately_to_maxlen(clean_redis_url):
    async def scenario(redis):
        for i in range(1000):
            await add(redis, "trimmed", {"n": i}, maxlen=100)
        assert 100 <= await redis.xlen("trimmed") < 1000

    run_with_redis(clean_redis_url, scenario)


def test_read_next_needs_a_stream(clean_redis_url):
    async def scenario(redis):
        with pytest.raises(ValueError):
            await read_next(redis, [], GROUP, "c1", block_ms=0)

    run_with_redis(clean_redis_url, scenario)


def test_add_many_adds_every_entry_in_order_to_its_stream(clean_redis_url):
    async def scenario(redis):
        ids = await add_many(redis, [(HIGH, {"n": "1"}), (LOW, {"n": "2"}), (HIGH, {"n": "3"})], maxlen=100)
        assert len(ids) == 3 and ids[0] < ids[2]
        high = await redis.xrange(HIGH)
        assert [(entry_id.decode(), fields) for entry_id, fields in high] == [
            (ids[0], {b"n": b"1"}),
            (ids[2], {b"n": b"3"}),
        ]
        assert [fields for _, fields in await redis.xrange(LOW)] == [{b"n": b"2"}]

    run_with_redis(clean_redis_url, scenario)
