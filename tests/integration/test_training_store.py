"""Training job records and the training queue on a real Redis (libs/training/jobs.py, queue.py):
a job and its queue entry are written together; status changes are compare-and-set, so a cancel
and a trainer's start never both win; a job's owner alone sees it; a trainer holds a job under a
lease, another takes the entry only once the lease is gone and the entry idle a whole lease, and a
second entry of a held job is refused."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from libs.training.jobs import CANCELLED, FAILED, PENDING, RUNNING, TrainingJobs
from libs.training.queue import TrainingQueue, job_id_of, lease_key

LEASE_MS = 200
SPEC = {"training_file": "file-1", "expert": {"name": "x"}}


def _run(redis_url: str, scenario) -> None:
    async def main():
        redis = Redis.from_url(redis_url)
        try:
            await scenario(redis)
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_job_is_queued_with_its_record_and_seen_by_its_owner_only(clean_redis_url):
    async def scenario(redis):
        jobs, queue = TrainingJobs(redis), TrainingQueue(redis, "trainer-a", LEASE_MS)
        await queue.setup()
        job = await jobs.create("key-1", SPEC)
        assert (await jobs.get(job.job_id, "key-1")).status == PENDING
        assert await jobs.get(job.job_id, "key-2") is None
        assert [j.job_id for j in await jobs.list("key-1")] == [job.job_id] and await jobs.list("key-2") == []
        entry = await queue.next(block_ms=0)
        assert job_id_of(entry) == job.job_id
        assert [e["type"] for e in await jobs.events(job.job_id)] == ["status"]

    _run(clean_redis_url, scenario)


def test_a_cancel_and_a_start_never_both_win(clean_redis_url):
    async def scenario(redis):
        jobs = TrainingJobs(redis)
        job = await jobs.create("key-1", SPEC)
        assert await jobs.cancel(job.job_id) == CANCELLED
        assert not await jobs.transition(job.job_id, (PENDING,), RUNNING)  # the trainer comes too late

        other = await jobs.create("key-1", SPEC)
        assert await jobs.transition(other.job_id, (PENDING,), RUNNING)
        assert await jobs.cancel(other.job_id) == RUNNING  # asked to stop, still running
        assert (await jobs.get(other.job_id)).cancel_requested
        assert await jobs.transition(other.job_id, (RUNNING,), FAILED, error="boom")
        assert await jobs.resume(other.job_id, "")  # back to PENDING, queued again, the request gone
        resumed = await jobs.get(other.job_id)
        assert (resumed.status, resumed.cancel_requested, resumed.error) == (PENDING, False, "")
        assert not await jobs.resume(other.job_id, "")  # a pending job cannot be resumed
        assert await jobs.cancel("ftjob-none") is None

    _run(clean_redis_url, scenario)


def test_a_checkpoint_request_has_its_id_until_served(clean_redis_url):
    async def scenario(redis):
        jobs = TrainingJobs(redis)
        job = await jobs.create("key-1", SPEC)
        assert await jobs.request_checkpoint(job.job_id) is None  # not running
        await jobs.transition(job.job_id, (PENDING,), RUNNING)
        asked = await jobs.request_checkpoint(job.job_id)
        assert asked.startswith("ckpt-") and await jobs.request_checkpoint(job.job_id) == asked
        metrics = {"step": 1, "total_steps": 9, "train_loss": 2.5}
        assert await jobs.report_step(job.job_id, metrics) == (False, asked)
        await jobs.cancel(job.job_id)
        assert await jobs.report_step(job.job_id, {**metrics, "step": 2}) == (True, asked)

    _run(clean_redis_url, scenario)


def test_a_job_is_taken_over_only_once_its_lease_is_gone_and_its_entry_idle(clean_redis_url):
    async def scenario(redis):
        jobs = TrainingJobs(redis)
        # trainer-a holds its lease for a minute; trainer-b takes entries idle for LEASE_MS.
        first, second = TrainingQueue(redis, "trainer-a", 60_000), TrainingQueue(redis, "trainer-b", LEASE_MS)
        await first.setup()
        job = await jobs.create("key-1", SPEC)
        entry = await first.next(block_ms=0)
        assert await first.hold(entry)
        await asyncio.sleep(2 * LEASE_MS / 1000)  # idle long enough, but held
        assert await second.orphans() == []
        assert not await second.hold(entry)  # a second entry of a held job is refused

        await redis.delete(lease_key(job.job_id))  # trainer-a died: its lease lapsed
        taken = await _until_taken(second)
        assert [e.id for e in taken] == [entry.id] and taken[0].deliveries == 2
        assert not await first.hold(entry)  # trainer-a, back, finds its lease taken
        await second.done(taken[0])
        assert await redis.xlen("expert:training:queue") == 0

    _run(clean_redis_url, scenario)


async def _until_taken(queue: TrainingQueue, deadline_s: float = 30.0) -> list:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        taken = await queue.orphans()
        if taken:
            return taken
        await asyncio.sleep(0.05)
    raise AssertionError("the orphaned entry was never taken")
