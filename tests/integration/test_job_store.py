"""JobStore against a real redis-server: a job's runs and deliveries are counted apart (a failover
between engines is a new attempt, not a new delivery), and the admission script records what the
dispatcher needs (reception time, whether a client streams)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from libs.gen.expert.v1 import common_pb2
from services.reception.jobs import JobStore, events_key


def _run(url: str, scenario) -> None:
    async def main():
        redis = Redis.from_url(url)
        try:
            await scenario(redis, JobStore(redis, ttl_s=60))
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_failovers_count_as_attempts_and_only_dispatcher_takes_as_deliveries(clean_redis_url):
    async def scenario(redis, jobs):
        await jobs.create("j", common_pb2.InferenceRequest(prompt="hi"), priority=5)
        taken = await jobs.begin("j", common_pb2.JOB_STATUS_PLANNING, delivery=True)
        assert (taken.attempts, taken.deliveries, taken.status) == (1, 1, common_pb2.JOB_STATUS_PLANNING)
        for _ in range(2):  # the engine failed twice: the same dispatcher places the job again
            again = await jobs.begin("j")
        assert (again.attempts, again.deliveries) == (3, 1)
        reclaimed = await jobs.begin("j", common_pb2.JOB_STATUS_PLANNING, delivery=True)
        assert (reclaimed.attempts, reclaimed.deliveries) == (4, 2)
        kinds = [fields[b"kind"] for _, fields in await redis.xrange(events_key("j"))]
        assert kinds.count(b"restart") == 3  # readers discard the text of each earlier run

    _run(clean_redis_url, scenario)


def test_admission_records_the_reception_time_and_whether_a_client_streams(clean_redis_url):
    async def scenario(redis, jobs):
        await jobs.create("s", common_pb2.InferenceRequest(prompt="hi"), 5, reception_ms=0.25, streaming=True)
        await jobs.create("n", common_pb2.InferenceRequest(prompt="hi"), 5)
        streamed, plain = await jobs.get("s"), await jobs.get("n")
        assert (streamed.reception_ms, streamed.streaming) == (0.25, True)
        assert (plain.reception_ms, plain.streaming, plain.deliveries) == (0.0, False, 0)

    _run(clean_redis_url, scenario)
