"""The trainers' leases on a real Redis (libs/training/queue.py over libs/stream_lease.py, the rule
reception's dispatchers follow too): a trainer takes over a job only once its lease has stayed gone
for a whole lease while it kept looking, never for a lapse alone; a trainer whose Redis goes away
and comes back keeps its job, which runs once and is not lost.

The outage test runs two real trainer workers (services/trainer/worker.py) against a redis-server
with its append-only file that is killed and started again. Their runs do not train a model: the
training is a workload the test ends when it likes (`HeldRun`), since what is tested is who runs the
job and how often, and a real run's length could not be held across the outage.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from libs.redis_client import connect
from libs.training.jobs import COMPLETED, TrainingJob, TrainingJobs
from libs.training.queue import GROUP, QUEUE_STREAM, TrainingQueue, lease_key
from services.trainer.config import TrainerConfig
from services.trainer.job_control import Interrupted, Stops
from services.trainer.metrics import TrainerMetrics
from services.trainer.runner import JobRunner
from services.trainer.worker import Worker
from tests.helpers.clock import ManualClock
from tests.helpers.redis_server import durable_redis_server

LEASE_MS = 200
SPEC = {"training_file": "file-1", "expert": {"name": "x"}}
DEADLINE_S = 30.0


def _run(redis_url: str, scenario) -> None:
    async def main():
        redis = Redis.from_url(redis_url)
        try:
            jobs, clock = TrainingJobs(redis), ManualClock(1000.0)
            holder = TrainingQueue(redis, "trainer-a", LEASE_MS)
            other = TrainingQueue(redis, "trainer-b", LEASE_MS, clock=clock)
            await holder.setup()
            job = await jobs.create("key-1", SPEC)
            entry = await holder.next(block_ms=0)
            assert await holder.hold(entry)
            await asyncio.sleep(2 * LEASE_MS / 1000)  # trainer-a stopped renewing: its lease lapsed
            await scenario(redis, job, entry, holder, other, clock)
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_job_whose_lease_lapsed_is_taken_only_after_a_whole_lease_without_it(clean_redis_url):
    async def scenario(redis, job, entry, holder, other, clock):
        assert await other.orphans() == []  # first seen gone: a suspicion
        clock.now += LEASE_MS / 1000 / 2
        assert await other.orphans() == []
        clock.now += LEASE_MS / 1000 / 2
        (taken,) = await other.orphans()
        assert (taken.id, taken.fields["job_id"], taken.deliveries) == (entry.id, job.job_id.encode(), 2)
        assert await redis.get(lease_key(job.job_id)) == b"trainer-b"
        assert not await holder.hold(entry)  # trainer-a learns it lost the job at its next renewal
        await holder.let_go(entry)
        assert await redis.get(lease_key(job.job_id)) == b"trainer-b"

    _run(clean_redis_url, scenario)


def test_a_trainer_that_renews_after_an_outage_keeps_its_job(clean_redis_url):
    async def scenario(redis, job, entry, holder, other, clock):
        assert await other.orphans() == []  # seen gone
        assert await holder.hold(entry)  # trainer-a is back within the lease the other waits
        clock.now += LEASE_MS / 1000
        assert await other.orphans() == []
        assert await redis.get(lease_key(job.job_id)) == b"trainer-a"

    _run(clean_redis_url, scenario)


def test_a_pause_of_over_a_lease_between_looks_starts_the_wait_over(clean_redis_url):
    """A trainer that has not looked for over a lease (it was training a job) cannot tell whether
    Redis went away meanwhile: what it saw before counts for nothing."""

    async def scenario(redis, job, entry, holder, other, clock):
        assert await other.orphans() == []
        clock.now += 3 * LEASE_MS / 1000
        assert await other.orphans() == []  # seen gone, from now
        clock.now += LEASE_MS / 1000
        assert [e.id for e in await other.orphans()] == [entry.id]

    _run(clean_redis_url, scenario)


class HeldRun(JobRunner):
    """A JobRunner whose training is a wait the test ends (module docstring): everything around it,
    the job's final transition and event, is the real runner's."""

    def __init__(self, jobs: TrainingJobs, started: list[str], release: asyncio.Event) -> None:
        super().__init__(TrainerConfig.from_env({}), jobs, None, None, TrainerMetrics(CollectorRegistry()))
        self.started, self.release = started, release
        self.trainer = ""

    async def _train_and_publish(self, job: TrainingJob, stops: Stops) -> dict:
        self.started.append(self.trainer)
        while not self.release.is_set():
            if stops.lease_lost.is_set():
                raise Interrupted("another trainer holds the job now")
            await asyncio.sleep(0.01)
        return {"model": "held-run-expert"}


def _trainer(url: str, name: str, lease_ms: int, started: list[str], release: asyncio.Event):
    redis = connect(url)
    jobs = TrainingJobs(redis)
    runner = HeldRun(jobs, started, release)
    runner.trainer = name
    return redis, Worker(TrainingQueue(redis, name, lease_ms), jobs, runner, max_deliveries=3)


async def _until(check, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not await check():
        assert loop.time() < end, f"never {what}"
        await asyncio.sleep(0.02)


def test_a_trainer_whose_redis_goes_away_and_comes_back_keeps_its_job_and_runs_it_once():
    lease_ms = 2000

    async def main(server):
        started: list[str] = []
        release = asyncio.Event()
        redis_a, first = _trainer(server.url, "trainer-a", lease_ms, started, release)
        redis_b, second = _trainer(server.url, "trainer-b", lease_ms, started, release)
        observer = connect(server.url)
        tasks: list[asyncio.Task] = []
        try:
            await TrainingQueue(observer, "observer").setup()
            job = await TrainingJobs(observer).create("key-1", SPEC)
            tasks.append(asyncio.create_task(first.run()))

            async def running_on_a() -> bool:
                return started == ["trainer-a"]

            await _until(running_on_a, "started on trainer-a")

            server.kill()
            await asyncio.sleep(1.5 * lease_ms / 1000)  # the outage: longer than the lease
            await asyncio.to_thread(server.start)  # the lease comes back expired from the file
            # trainer-b starts as Redis is back, and looks for orphans at once: before trainer-a,
            # which renews a third of a lease apart, has renewed (the moment a claim without the
            # guard would take the job)
            tasks.append(asyncio.create_task(second.run()))

            async def renewed_by_a() -> bool:
                return await observer.get(lease_key(job.job_id)) == b"trainer-a"

            # Once trainer-a has its lease back, nobody can take the job from it any more.
            await _until(renewed_by_a, "renewed by trainer-a after the outage (not taken by trainer-b)")
            release.set()

            async def completed() -> bool:
                return (await first.jobs.get(job.job_id)).status == COMPLETED

            await _until(completed, "completed")
            assert started == ["trainer-a"]  # run once, by the trainer that held it all along
            record = await first.jobs.get(job.job_id)
            assert record.expert == {"model": "held-run-expert"}
            assert await observer.xlen(QUEUE_STREAM) == 0
            assert (await observer.xpending(QUEUE_STREAM, GROUP))["pending"] == 0
        finally:
            first.stop()
            second.stop()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for client in (redis_a, redis_b, observer):
                await client.aclose()

    with durable_redis_server() as server:
        asyncio.run(main(server))
