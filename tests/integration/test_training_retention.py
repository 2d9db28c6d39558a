"""Retention of ended training jobs on a real Redis (libs/training/jobs.py, retention.py,
services/trainer/checkpoint_sweep.py): a job's record and events expire the retention after it
ends (completed, failed or cancelled), never while it lives, and a resume takes the expiry away;
nothing is written for a job that is gone; the owner's list forgets expired jobs; the trainers
remove the checkpoint directories of jobs past their retention, and of records gone for as long,
and keep everything else."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

from redis.asyncio import Redis

from libs.training.jobs import (
    CANCELLED,
    COMPLETED,
    FAILED,
    OWNER_PREFIX,
    PENDING,
    RUNNING,
    TrainingJobs,
    events_key,
    job_key,
)
from libs.training.queue import TrainingQueue
from libs.training.retention import DEFAULT_RETENTION_S, retention_from_env
from services.trainer.checkpoint_sweep import CheckpointSweeper
from services.trainer.worker import Worker

SPEC = {"training_file": "file-1", "expert": {"name": "x"}}
DEADLINE_S = 30.0


def _run(redis_url: str, scenario) -> None:
    async def main():
        redis = Redis.from_url(redis_url)
        try:
            await scenario(redis)
        finally:
            await redis.aclose()

    asyncio.run(main())


async def _ttls(redis: Redis, job_id: str) -> tuple[int, int]:
    return await redis.pttl(job_key(job_id)), await redis.pttl(events_key(job_id))


async def _until(check, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not await check():
        assert loop.time() < end, f"never {what}"
        await asyncio.sleep(0.05)


def test_the_retention_setting():
    assert retention_from_env({}) == DEFAULT_RETENTION_S == 7 * 24 * 3600
    assert retention_from_env({"EXPERT_TRAINING_JOB_RETENTION_SECONDS": "60"}) == 60


def test_an_ended_job_expires_after_the_retention_and_a_live_one_never(clean_redis_url):
    async def scenario(redis):
        jobs = TrainingJobs(redis, retention_s=1)
        done = await jobs.create("key-1", SPEC)
        assert await jobs.transition(done.job_id, (PENDING,), RUNNING)
        assert await _ttls(redis, done.job_id) == (-1, -1)  # a live job never expires
        assert await jobs.transition(done.job_id, (RUNNING,), COMPLETED, finished_at=repr(time.time()))
        assert await jobs.event(done.job_id, "status", "job completed")  # after the end: expires too
        assert all(0 < ttl <= 1000 for ttl in await _ttls(redis, done.job_id))

        cancelled = await jobs.create("key-1", SPEC)
        assert await jobs.cancel(cancelled.job_id) == CANCELLED  # a pending job ends at once
        assert all(0 < ttl <= 1000 for ttl in await _ttls(redis, cancelled.job_id))

        resumed = await jobs.create("key-1", SPEC)
        await jobs.transition(resumed.job_id, (PENDING,), RUNNING)
        await jobs.transition(resumed.job_id, (RUNNING,), FAILED, error="boom")
        assert all(ttl > 0 for ttl in await _ttls(redis, resumed.job_id))
        assert await jobs.resume(resumed.job_id, "")  # live again: kept for good
        assert await _ttls(redis, resumed.job_id) == (-1, -1)

        async def ended_ones_gone() -> bool:
            return not await redis.exists(
                job_key(done.job_id), events_key(done.job_id), job_key(cancelled.job_id)
            )

        await _until(ended_ones_gone, "expired")
        assert await jobs.get(done.job_id) is None
        assert not await jobs.event(done.job_id, "status", "late")  # nothing recreated without a TTL
        assert not await redis.exists(events_key(done.job_id))
        assert [j.job_id for j in await jobs.list("key-1")] == [resumed.job_id]
        assert await redis.zrange(OWNER_PREFIX + "key-1", 0, -1) == [resumed.job_id.encode()]

    _run(clean_redis_url, scenario)


def _job_dir(root: Path, name: str, age_s: float = 0.0) -> Path:
    directory = root / name / "ckpt-1"
    directory.mkdir(parents=True)
    (directory / "trainer_state.pt").write_bytes(b"state")
    if age_s:
        then = time.time() - age_s
        os.utime(root / name, (then, then))
    return root / name


def test_the_sweep_removes_the_checkpoints_of_jobs_past_their_retention_only(clean_redis_url, tmp_path):
    async def scenario(redis):
        jobs = TrainingJobs(redis, retention_s=60)
        old, recent, live = [await jobs.create("key-1", SPEC) for _ in range(3)]
        await jobs.cancel(old.job_id)
        await jobs.update(old.job_id, finished_at=repr(time.time() - 120))  # ended two minutes ago
        await jobs.cancel(recent.job_id)
        await jobs.transition(live.job_id, (PENDING,), RUNNING)
        dirs = {
            "old": _job_dir(tmp_path, old.job_id),
            "recent": _job_dir(tmp_path, recent.job_id),
            "live": _job_dir(tmp_path, live.job_id, age_s=120),  # running: never swept, however old
            "gone": _job_dir(tmp_path, "ftjob-gone", age_s=120),  # record gone, dir untouched 2 min
            "gone_new": _job_dir(tmp_path, "ftjob-new"),  # record gone (Redis lost it), dir fresh
            "other": _job_dir(tmp_path, "notes", age_s=120),  # not a job's
        }
        sweeper = CheckpointSweeper(tmp_path, jobs, retention_s=60)
        assert sorted(await sweeper.sweep_if_due()) == sorted([old.job_id, "ftjob-gone"])
        assert {name for name, path in dirs.items() if path.exists()} == {
            "recent",
            "live",
            "gone_new",
            "other",
        }
        await jobs.update(recent.job_id, finished_at=repr(time.time() - 120))
        assert await sweeper.sweep_if_due() == []  # not due again before its interval
        assert await sweeper.sweep() == [recent.job_id]

    _run(clean_redis_url, scenario)


def test_an_idle_trainer_removes_the_checkpoints_of_a_job_whose_record_expired(clean_redis_url, tmp_path):
    async def scenario(redis):
        jobs = TrainingJobs(redis, retention_s=1)
        job = await jobs.create("key-1", SPEC)
        await jobs.cancel(job.job_id)
        directory = _job_dir(tmp_path, job.job_id)
        sweeper = CheckpointSweeper(tmp_path, jobs, retention_s=1)
        # No job comes: the worker's loop only sweeps, and waits for entries.
        worker = Worker(TrainingQueue(redis, "trainer-a", 400), jobs, None, 3, sweeper)
        loop = asyncio.create_task(worker.run())
        try:

            async def swept() -> bool:
                return not directory.exists()

            await _until(swept, "swept")
            assert not await redis.exists(job_key(job.job_id))  # its record went the same way
        finally:
            worker.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(loop, DEADLINE_S)

    _run(clean_redis_url, scenario)
