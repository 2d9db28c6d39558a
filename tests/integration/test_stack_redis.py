"""The redis-server that LocalStack starts (as `expertctl up` does): with `redis_durable`, a queued
job (its record, its queue entry and the dispatchers' consumer group) is still there after Redis is
killed and started again; without it, nothing is. Under its memory cap, Redis evicts only keys that
expire (job records), never the queue. It asks for a password, and its files are the owner's only."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
from redis.asyncio import Redis

from libs.gen.expert.v1 import common_pb2
from libs.redis_streams import read_next
from services.reception.jobs import JobStore, job_key
from services.reception.queue import GROUP, STREAMS, JobQueue, stream
from tools.stack import LocalStack

JOB_TTL_S = 3600


def _run(url: str, scenario):
    async def main():
        redis = Redis.from_url(url)
        try:
            return await scenario(redis)
        finally:
            await redis.aclose()

    return asyncio.run(main())


async def _queue_a_job(redis: Redis) -> None:
    """What reception does on Submit: the queue's groups exist, then the record and the queue
    entry are written in one step."""
    await JobQueue(redis).setup()
    request = common_pb2.InferenceRequest(prompt="Hello", max_tokens=8)
    await JobStore(redis, ttl_s=JOB_TTL_S).create("job-1", request, priority=5, queue=stream(5))


async def _written_to_the_append_only_file(redis: Redis) -> None:
    """Wait until Redis has handed its append-only buffer to the file. Under `appendfsync
    everysec` Redis may hold writes back for up to 2 s while a background fsync is slow (a loaded
    machine) and still answer the client, so a SIGKILL right after a write can lose it; that window
    is everysec's documented price, not the property under test."""
    for _ in range(200):
        info = await redis.info("persistence")
        if info["aof_buffer_length"] == 0 and not info.get("aof_rewrite_in_progress"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("Redis did not write its append-only buffer within 10 s")


async def _config(redis: Redis) -> dict[str, str]:
    return await redis.config_get("*")  # redis-py decodes CONFIG GET


def test_a_durable_stack_keeps_a_queued_job_across_a_redis_restart(tmp_path):
    stack = LocalStack.on_free_ports(tmp_path, redis_durable=True)
    stack.start_redis()
    try:
        _run(stack.redis_url, _queue_a_job)
        _run(stack.redis_url, _written_to_the_append_only_file)
        stack.restart_redis()  # SIGKILL, then a new redis-server on the same port and directory

        async def still_queued(redis: Redis) -> None:
            record = await JobStore(redis, ttl_s=JOB_TTL_S).get("job-1")
            assert record is not None, "the job record was lost"
            assert record.status == common_pb2.JOB_STATUS_QUEUED and record.request.prompt == "Hello"
            assert 0 < await redis.ttl(job_key("job-1")) <= JOB_TTL_S  # it still expires
            entry = await read_next(redis, STREAMS, GROUP, "dispatcher-1", block_ms=0)
            assert entry is not None, "the queue entry or its consumer group was lost"
            assert (entry.stream, entry.fields["job_id"]) == (stream(5), b"job-1")

        _run(stack.redis_url, still_queued)
        config = _run(stack.redis_url, _config)
    finally:
        stack.stop()
    assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")
    assert (tmp_path / "redis" / "appendonlydir").is_dir()


def test_a_stack_that_is_not_durable_loses_its_queue_when_redis_restarts(tmp_path):
    stack = LocalStack.on_free_ports(tmp_path)
    stack.start_redis()
    try:
        _run(stack.redis_url, _queue_a_job)
        stack.restart_redis()

        async def gone(redis: Redis) -> None:
            assert await redis.exists(job_key("job-1"), stream(5)) == 0

        _run(stack.redis_url, gone)
        config = _run(stack.redis_url, _config)
    finally:
        stack.stop()
    assert config["appendonly"] == "no"
    assert (config["maxmemory"], config["maxmemory-policy"]) == (str(512 << 20), "volatile-ttl")


def test_under_its_memory_cap_redis_evicts_job_records_but_never_the_queue(tmp_path):
    stack = LocalStack.on_free_ports(tmp_path, redis_maxmemory="4mb")
    stack.start_redis()
    try:

        async def fill(redis: Redis) -> tuple[int, int]:
            await _queue_a_job(redis)
            for i in range(400):  # 400 records of 20 kB with a TTL: twice the cap
                await redis.set(f"expert:job:filler-{i}:text", b"x" * 20_000, ex=JOB_TTL_S + i)
            entry = await read_next(redis, STREAMS, GROUP, "dispatcher-1", block_ms=0)
            assert entry is not None and entry.fields["job_id"] == b"job-1"
            return await redis.dbsize(), int((await redis.info("stats"))["evicted_keys"])

        keys, evicted = _run(stack.redis_url, fill)
    finally:
        stack.stop()
    assert evicted > 0 and keys < 400, (keys, evicted)


def test_the_stacks_redis_refuses_a_client_without_its_password(tmp_path):
    """Another local user could otherwise read every prompt, or write an admin key. The password
    is not on redis-server's command line (any user can read that); a restarted one keeps it."""
    stack = LocalStack.on_free_ports(tmp_path, redis_durable=True)
    stack.start_redis()
    try:
        url = urlparse(stack.redis_url)
        assert (url.hostname, len(url.password)) == ("127.0.0.1", 64)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=url.port).set("expert:apikey:forged", "admin")
        command_line = Path(f"/proc/{stack.supervised()['redis'].pid}/cmdline").read_bytes()
        assert url.password.encode() not in command_line
        stack.restart_redis()
        assert redis.Redis.from_url(stack.redis_url).ping()
        assert urlparse(stack.redis_url).password == url.password
    finally:
        stack.stop()


def test_the_redis_directory_is_the_owners_only_even_one_left_open_before(tmp_path):
    directory = tmp_path / "redis"
    (directory / "appendonlydir").mkdir(parents=True, mode=0o755)
    old = directory / "appendonlydir" / "appendonly.aof.1.incr.aof"
    old.write_bytes(b"")
    old.chmod(0o644)  # what an earlier version left
    stack = LocalStack.on_free_ports(tmp_path, redis_durable=True)
    stack.start_redis()
    try:
        _run(stack.redis_url, _queue_a_job)
        written = _run(stack.redis_url, _aof_flushed)
    finally:
        stack.stop()
    assert written
    modes = {path.relative_to(tmp_path): stat.S_IMODE(path.stat().st_mode) for path in directory.rglob("*")}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {path.name for path in directory.rglob("*.aof")}  # the job went to disk
    assert modes == {p: 0o700 if (tmp_path / p).is_dir() else 0o600 for p in modes}, modes
    assert (directory / "password").read_text().strip() == urlparse(stack.redis_url).password


async def _aof_flushed(redis_client: Redis) -> bool:
    for _ in range(100):
        if int((await redis_client.info("persistence"))["aof_buffer_length"]) == 0:
            return True
        await asyncio.sleep(0.05)
    return False
