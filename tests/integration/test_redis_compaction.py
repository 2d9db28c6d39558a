"""With EXPERT_STORE_REQUEST_TEXT=false, an ended job's prompt and output leave the disk too: the
launcher's redis-server (append-only file, no RDB snapshots) and the real JobStore with the
compaction loop (short intervals), and every file in Redis's directory read as bytes. Without the
compaction the texts stay in the append-only file (the deleted keys' writes); with the texts kept
nothing is rewritten; a Redis that refuses BGREWRITEAOF (an ACL) or has no append-only file costs
no job."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from urllib.parse import urlparse

from redis.asyncio import Redis

from libs.gen.expert.v1 import common_pb2
from services.reception.jobs import JobStore
from services.reception.redis_compaction import PENDING, Compactor
from tools.stack import LocalStack

GRACE_S = 1  # the streams' expiry after a job ends (60 s in service)
INTERVAL_S = 2.0  # EXPERT_REDIS_COMPACT_SECONDS (60 s in service)
DEADLINE_S = 20.0  # generous: the bound is GRACE_S + INTERVAL_S + the rewrite time


def _files_hold(directory: Path, markers: list[bytes]) -> list[bytes]:
    """The markers found in any file under `directory`, read as bytes."""
    data = b"".join(path.read_bytes() for path in directory.rglob("*") if path.is_file())
    return [marker for marker in markers if marker in data]


async def _until(condition, what: str) -> float:
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < DEADLINE_S, f"not within {DEADLINE_S:g} s: {what}"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def _run_job(jobs: JobStore, job_id: str, marker: str) -> list[bytes]:
    """A job whose prompt, messages, body, streamed output and result carry `marker`, run to its end
    as the dispatcher writes it; the byte strings that must leave the disk."""
    prompt, output = f"prompt {marker}-in", f"answer {marker}-out"
    request = common_pb2.InferenceRequest(
        prompt=prompt,
        body=f'{{"secret": "{marker}-body"}}',
        messages=[common_pb2.ChatMessage(role="user", content=f"turn {marker}-msg")],
    )
    await jobs.create(job_id, request, 5)
    await jobs.begin(job_id, common_pb2.JOB_STATUS_RUNNING, delivery=True)
    for word in output.split():
        await jobs.append_delta(job_id, common_pb2.ChoiceDelta(text=word + " "))
    result = common_pb2.InferenceResult(job_id=job_id, status=common_pb2.JOB_STATUS_COMPLETED, text=output)
    result.choices.add(text=output)
    assert await jobs.finish(job_id, result)
    return [f"{marker}-{part}".encode() for part in ("in", "out", "body", "msg")]


def _durable_redis(tmp_path: Path) -> LocalStack:
    stack = LocalStack.on_free_ports(tmp_path, redis_durable=True)
    stack.start_redis()
    return stack


async def _strict(redis: Redis) -> None:
    # The rewritten file starts with an RDB image, whose long strings Redis may LZF-compress: a
    # live text could then escape a plain byte search. Off here, so the search sees every text.
    await redis.config_set("rdbcompression", "no")


def test_an_ended_jobs_texts_leave_the_append_only_file_within_the_bound(tmp_path):
    stack = _durable_redis(tmp_path)
    outcomes: list[str] = []

    async def scenario() -> None:
        redis = Redis.from_url(stack.redis_url)
        await _strict(redis)
        jobs = JobStore(redis, ttl_s=3600, store_text=False, follower_grace_s=GRACE_S)
        compactor = Compactor(redis, INTERVAL_S, outcomes.append, check_every_s=0.1)
        task = asyncio.create_task(compactor.run())
        try:
            markers = []
            for n in range(3):
                markers += await _run_job(jobs, f"job-{n}", secrets.token_hex(8))
            ended = time.monotonic()
            # the texts did reach the disk (fsync every second): the search below can see them
            await _until(lambda: _async(bool(_files_hold(tmp_path, markers))), "texts on disk")
            await _until(lambda: _async(not _files_hold(tmp_path, markers)), "texts off disk")
            took = time.monotonic() - ended
            assert took < GRACE_S + INTERVAL_S + 5.0, took
            assert outcomes and set(outcomes) == {"rewritten"}
            assert await redis.zcard(PENDING) == 0
            record = await jobs.get("job-0")  # the record stays, without its texts
            assert record.status == common_pb2.JOB_STATUS_COMPLETED and record.request.prompt == ""
        finally:
            task.cancel()
            await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        stack.stop()


def test_with_the_texts_kept_nothing_is_rewritten(tmp_path):
    stack = _durable_redis(tmp_path)

    async def scenario() -> None:
        redis = Redis.from_url(stack.redis_url)
        await _strict(redis)
        jobs = JobStore(redis, ttl_s=3600, store_text=True, follower_grace_s=GRACE_S)
        outcomes: list[str] = []
        compactor = Compactor(redis, INTERVAL_S, outcomes.append, check_every_s=0.1)
        try:
            markers = await _run_job(jobs, "kept", secrets.token_hex(8))
            assert await redis.zcard(PENDING) == 0
            await asyncio.sleep(GRACE_S + 0.1)  # past the grace a store_text=false job would have
            assert await compactor.compact_due() is None and outcomes == []
            assert (await redis.info("persistence"))["aof_rewrites"] == 0
            await _until(lambda: _async(len(_files_hold(tmp_path, markers)) == 4), "texts")
            assert (await jobs.get("kept")).request.prompt.endswith("-in")
        finally:
            await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        stack.stop()


def test_a_redis_that_refuses_the_rewrite_or_has_no_file_costs_no_job(tmp_path, clean_redis_url):
    stack = _durable_redis(tmp_path)

    async def scenario() -> None:
        admin = Redis.from_url(stack.redis_url)
        # a managed Redis's ACL: every command but BGREWRITEAOF
        await admin.acl_setuser(
            "limited",
            enabled=True,
            passwords=["+pw"],
            keys="*",
            channels="*",
            commands=["+@all", "-bgrewriteaof"],
        )
        port = urlparse(stack.redis_url).port
        limited = Redis(host="127.0.0.1", port=port, username="limited", password="pw")
        no_aof = Redis.from_url(clean_redis_url)  # the tests' redis-server: no persistence at all
        outcomes: list[str] = []
        try:
            for redis in (limited, no_aof):
                jobs = JobStore(redis, ttl_s=3600, store_text=False, follower_grace_s=GRACE_S)
                compactor = Compactor(redis, INTERVAL_S, outcomes.append, check_every_s=0.1)
                await _run_job(jobs, "j", secrets.token_hex(8))
                assert (await jobs.get("j")).status == common_pb2.JOB_STATUS_COMPLETED
                await _until(lambda c=compactor: _async_await(c.compact_due()), "a compaction attempt")
                assert await redis.zcard(PENDING) == 0  # given up, not piling up
            assert outcomes == ["refused", "no_aof"]
        finally:
            for client in (admin, limited, no_aof):
                await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        stack.stop()


async def _async(value):
    return value


async def _async_await(awaitable):
    return await awaitable is not None
