"""JobStore against a real redis-server: a job's runs and deliveries are counted apart (a failover
between engines is a new attempt, not a new delivery), and the admission script records what the
dispatcher needs (reception time, whether a client streams)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from redis.asyncio import Redis

from libs.gen.expert.v1 import common_pb2
from services.reception.audit import AuditLog
from services.reception.job_events import Delta, Finished, JobEvent, StatusChanged
from services.reception.jobs import JobExpired, JobStore, events_key, job_key


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


def test_every_recorded_final_result_is_reported_once_whoever_ended_the_job(clean_redis_url):
    async def scenario(redis, jobs):
        seen: list[tuple[str, int]] = []
        jobs.on_finished = lambda result: seen.append((result.job_id, result.status))
        request = common_pb2.InferenceRequest(prompt="hi", timeout_ms=1)
        await jobs.create("late", request, 5)  # queued past its deadline: the sweep ends it
        await jobs.create("done", common_pb2.InferenceRequest(prompt="hi"), 5)
        await asyncio.sleep(0.01)
        assert await jobs.sweep_overdue(30.0) == [("late", common_pb2.JOB_STATUS_QUEUED)]
        completed = common_pb2.InferenceResult(job_id="done", status=common_pb2.JOB_STATUS_COMPLETED)
        assert await jobs.finish("done", completed)
        cancelled = common_pb2.InferenceResult(job_id="done", status=common_pb2.JOB_STATUS_CANCELLED)
        assert not await jobs.finish("done", cancelled)  # a final status is never overwritten
        assert seen == [("late", common_pb2.JOB_STATUS_TIMED_OUT), ("done", common_pb2.JOB_STATUS_COMPLETED)]

    _run(clean_redis_url, scenario)


def test_every_final_state_gives_one_audit_line_with_the_request_even_without_stored_text(
    clean_redis_url, tmp_path
):
    path = tmp_path / "audit.log"

    async def scenario(redis, _):
        jobs = JobStore(redis, ttl_s=60, store_text=False, audit=AuditLog(str(path)))
        await jobs.create("late", common_pb2.InferenceRequest(prompt="late one", timeout_ms=1), 5)
        await jobs.create("done", common_pb2.InferenceRequest(prompt="my secret", user_id="bob"), 5)
        await asyncio.sleep(0.01)
        assert await jobs.sweep_overdue(30.0) == [("late", common_pb2.JOB_STATUS_QUEUED)]
        completed = common_pb2.InferenceResult(
            job_id="done", status=common_pb2.JOB_STATUS_COMPLETED, text="the answer"
        )
        cancelled = common_pb2.InferenceResult(job_id="done", status=common_pb2.JOB_STATUS_CANCELLED)
        assert await jobs.finish("done", completed) and not await jobs.finish("done", cancelled)
        assert not await jobs.finish("gone", cancelled)  # no record: nothing recorded, no line

    _run(clean_redis_url, scenario)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["job_id"], line["status"]) for line in lines] == [
        ("late", "TIMED_OUT"),
        ("done", "COMPLETED"),
    ]
    assert lines[1]["user"] == "bob"
    assert lines[1]["prompt_sha256"] == hashlib.sha256(b"my secret").hexdigest()
    assert lines[1]["output_sha256"] == hashlib.sha256(b"the answer").hexdigest()
    assert "my secret" not in path.read_text() and "the answer" not in path.read_text()


def test_the_queue_depth_counts_the_entries_no_dispatcher_took_by_priority(clean_redis_url):
    from libs.redis_streams import read_next
    from services.reception.queue import GROUP, STREAMS, JobQueue, stream

    async def scenario(redis, jobs):
        queue = JobQueue(redis)
        await queue.setup()
        for job_id, priority in (("a", 9), ("b", 9), ("c", 2)):
            await jobs.create(
                job_id, common_pb2.InferenceRequest(prompt="hi"), priority, queue=stream(priority)
            )
        assert (await queue.depths())[9] == 2 and (await queue.depths())[2] == 1
        taken = await read_next(redis, STREAMS, GROUP, "worker", block_ms=0)
        assert taken.fields["job_id"] == b"a"
        depths = await queue.depths()
        assert (depths[9], depths[2], sum(depths.values())) == (1, 1, 2)

    _run(clean_redis_url, scenario)


def test_following_a_job_yields_its_events_in_order_or_only_its_result(clean_redis_url):
    async def scenario(redis, jobs):
        await jobs.create("j", common_pb2.InferenceRequest(prompt="hi"), priority=5)
        await jobs.set_status("j", common_pb2.JOB_STATUS_RUNNING)
        await jobs.append_delta("j", common_pb2.ChoiceDelta(text="Par"))
        await jobs.append_delta("j", common_pb2.ChoiceDelta(text="is"))
        await jobs.finish("j", common_pb2.InferenceResult(job_id="j", status=common_pb2.JOB_STATUS_COMPLETED))

        async def until_result(**options) -> list[JobEvent]:
            events = []
            async for event in jobs.follow("j", **options):
                events.append(event)
                if isinstance(event, Finished):
                    return events
            raise AssertionError("no result")

        every = await until_result()
        assert [e for e in every if not isinstance(e, StatusChanged)] == [
            Delta(common_pb2.ChoiceDelta(text="Par")),
            Delta(common_pb2.ChoiceDelta(text="is")),
            Finished(common_pb2.InferenceResult(job_id="j", status=common_pb2.JOB_STATUS_COMPLETED)),
        ]
        statuses = [e.status for e in every if isinstance(e, StatusChanged)]
        assert statuses[-2:] == [common_pb2.JOB_STATUS_RUNNING, common_pb2.JOB_STATUS_COMPLETED]
        assert [type(e) for e in await until_result(result_only=True)] == [Finished]

    _run(clean_redis_url, scenario)


def test_following_a_job_whose_record_expired_says_so(clean_redis_url):
    async def scenario(redis, jobs):
        jobs.follow_check_ms = 200  # the record is looked at after this long without an event
        await jobs.create("gone", common_pb2.InferenceRequest(prompt="hi"), priority=5)
        await redis.delete(job_key("gone"), events_key("gone"))
        with pytest.raises(JobExpired):
            async for _ in jobs.follow("gone"):
                pass

    _run(clean_redis_url, scenario)


def test_no_write_to_a_gone_job_leaves_a_key_without_a_ttl(clean_redis_url):
    """A job whose record expired (or Redis lost) while it still ran: its late chunks, status
    changes, cancel flag and result recreate nothing; a live job's evicted stream gets its TTL back."""

    async def scenario(redis, jobs):
        await jobs.append_delta("gone", common_pb2.ChoiceDelta(text="late chunk"))
        assert not await jobs.set_status("gone", common_pb2.JOB_STATUS_RUNNING)
        await jobs.request_cancel("gone")
        assert not await jobs.finish("gone", common_pb2.InferenceResult(job_id="gone"))
        assert await redis.keys("expert:job:gone*") == []
        await jobs.create("live", common_pb2.InferenceRequest(prompt="hi"), 5)
        await redis.delete(events_key("live"))  # as an eviction would
        await jobs.append_delta("live", common_pb2.ChoiceDelta(text="chunk"))
        assert 0 < await redis.ttl(events_key("live")) <= 60
        ttls = {key: await redis.ttl(key) for key in await redis.keys("expert:job:*")}
        assert all(ttl > 0 for ttl in ttls.values()), ttls

    _run(clean_redis_url, scenario)


def test_with_texts_not_stored_a_finished_job_keeps_only_their_hashes(clean_redis_url):
    async def scenario(redis, _):
        jobs = JobStore(redis, ttl_s=3600, store_text=False)
        request = common_pb2.InferenceRequest(
            prompt="my secret prompt",
            body="secret body",
            messages=[common_pb2.ChatMessage(role="user", content="secret turn")],
            temperature=0.5,
        )
        await jobs.create("j", request, 5)
        await jobs.append_delta("j", common_pb2.ChoiceDelta(text="secret output"))
        while_running = await jobs.get("j")
        assert while_running.request.prompt == "my secret prompt"  # the dispatcher needs it until the end
        result = common_pb2.InferenceResult(
            job_id="j", status=common_pb2.JOB_STATUS_COMPLETED, text="secret output", reasoning_trace="secret"
        )
        assert await jobs.finish("j", result)
        # a follower reading now still gets the result with its text
        async for event in jobs.follow("j", result_only=True):
            assert isinstance(event, Finished)
            assert event.result.text == "secret output"
            break
        record = await jobs.get("j")
        assert (record.request.prompt, record.request.body, list(record.request.messages)) == ("", "", [])
        assert record.request.temperature == 0.5 and record.result.status == common_pb2.JOB_STATUS_COMPLETED
        assert (record.result.text, record.result.reasoning_trace) == ("", "")
        assert await jobs.text("j") == ""
        stored = await redis.hgetall(job_key("j"))
        assert stored[b"output_sha256"].decode() == hashlib.sha256(b"secret output").hexdigest()
        assert len(stored[b"request_sha256"]) == 64
        assert b"secret" not in b"".join(stored.values())
        for key in (events_key("j"), "expert:job:j:result"):
            assert 0 < await redis.ttl(key) <= 60  # the streams that still hold it go within a minute

    _run(clean_redis_url, scenario)
