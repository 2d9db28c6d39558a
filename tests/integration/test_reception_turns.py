"""A session's turns through the job saga (`services/reception/dispatch/pipeline.py`), whose turn
policy (`dispatch/turns.py`) is all that differs from a plain job: against stages in memory and a
real Redis for the job and session records. The first turn is planned by the router; a later one
keeps that plan, asks for the session's engine and sends the engine the history with its new
messages; each turn settles in the session's record before its result is announced."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from redis.asyncio import Redis

from libs.gen.expert.v1 import common_pb2, preparation_pb2, session_pb2
from libs.job_results import failure_code
from services.reception.dispatch.pipeline import Pipeline
from services.reception.dispatch.run import JobRun
from services.reception.dispatch.turns import Turns
from services.reception.jobs import JobStore
from services.reception.sessions import NotLatest, SessionLimits, SessionStore, turn_messages, turn_request
from tests.integration.test_reception_saga import FakeStages

LIMITS = SessionLimits(idle_seconds=600.0, max_tokens=4096)


class RecordingStages(FakeStages):
    """FakeStages that keep every Plan, Prepare and Generate request."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.plans, self.prepares, self.generates = [], [], []

    async def plan(self, request, timeout):
        self.plans.append(request)
        return await super().plan(request, timeout)

    async def prepare(self, request, timeout):
        self.prepares.append(request)
        return await super().prepare(request, timeout)

    async def generate(self, address, request, timeout):
        self.generates.append(request)
        return await super().generate(address, request, timeout)


async def _turn(
    redis, stages, store: SessionStore, session_id: str, job_id: str
) -> common_pb2.InferenceResult:
    """Begin a turn of the session and run its job through the saga."""
    jobs = JobStore(redis, ttl_s=60)
    record = await store.begin_turn(session_id, job_id)
    await jobs.create(
        job_id, turn_request(record, session_pb2.GenerateStreamRequest()), 5, session_id=session_id
    )
    pipeline = Pipeline(
        jobs,
        stages,
        engine_retries=1,
        fleet=lambda: preparation_pb2.GetCapacityResponse(
            models=[common_pb2.ServedModel(name="tiny", max_model_len=1024)]
        ),
        place_retry_s=0.01,
        turns=Turns(store),
    )
    return await pipeline.run(JobRun(await jobs.get(job_id)))


def _session(redis_url: str, scenario):
    async def main():
        redis = Redis.from_url(redis_url)
        store = SessionStore(redis, LIMITS)
        settings = session_pb2.CreateSessionRequest(
            messages=[common_pb2.ChatMessage(role="user", content="The capital of France?")]
        )
        record = await store.create("s1", settings)
        try:
            return await scenario(redis, store, record.session_id)
        finally:
            await redis.aclose()

    return asyncio.run(main())


def test_a_later_turn_keeps_the_first_turns_plan_engine_and_history(clean_redis_url):
    stages = RecordingStages()

    async def scenario(redis, store, session_id):
        first = await _turn(redis, stages, store, session_id, "job-1")
        await store.append(session_id, [common_pb2.ChatMessage(role="user", content="And of Italy?")])
        second = await _turn(redis, stages, store, session_id, "job-2")
        return first, second, await store.get(session_id)

    first, second, record = _session(clean_redis_url, scenario)
    assert (first.status, second.status) == (common_pb2.JOB_STATUS_COMPLETED,) * 2
    assert len(stages.plans) == 1  # the router planned the first turn only
    first_place, second_place = stages.prepares
    assert (first_place.session, first_place.session_engine) == (True, "")
    assert (second_place.session, second_place.session_engine) == (True, "engine-1")
    assert second_place.plan.reasoning_trace.startswith("session turn 2:")
    first_input, second_input = stages.generates
    assert not first_input.HasField("input") and not second_input.HasField("input")
    assert [m.content for m in first_input.session.messages] == ["The capital of France?"]
    assert list(second_input.session.history) == [1, 2]  # the first turn's reply
    assert [m.content for m in second_input.session.messages] == ["And of Italy?"]
    assert (second_input.session.max_tokens, second_input.session.idle_seconds) == (4096, 600.0)
    assert (record.turns, record.job_id, record.engine_id) == (2, "", "engine-1")
    assert list(record.token_ids) == [1, 2, 1, 2]
    assert [m.role for m in record.messages] == ["user", "assistant", "user", "assistant"]


def test_a_plain_jobs_engine_gets_the_plans_input_and_no_session(clean_redis_url):
    stages = RecordingStages()

    async def main():
        redis = Redis.from_url(clean_redis_url)
        jobs = JobStore(redis, ttl_s=60)
        await jobs.create("job-1", common_pb2.InferenceRequest(prompt="Hello"), 5)
        pipeline = Pipeline(jobs, stages, engine_retries=0, fleet=preparation_pb2.GetCapacityResponse)
        result = await pipeline.run(JobRun(await jobs.get("job-1")))
        await redis.aclose()
        return result

    assert asyncio.run(main()).status == common_pb2.JOB_STATUS_COMPLETED
    (place,) = stages.prepares
    (generate,) = stages.generates
    assert not place.session and not generate.HasField("session")
    assert generate.input.text == "Hello"


def test_a_turn_the_engine_has_no_room_for_is_refused_and_gives_its_input_back(clean_redis_url):
    stages = RecordingStages(engines=(grpc.StatusCode.RESOURCE_EXHAUSTED,))

    async def scenario(redis, store, session_id):
        result = await _turn(redis, stages, store, session_id, "job-1")
        return result, await store.get(session_id)

    result, record = _session(clean_redis_url, scenario)
    assert result.status == common_pb2.JOB_STATUS_FAILED
    assert failure_code(result) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(stages.prepares) == 1  # refused, not placed again on another engine
    assert (record.job_id, record.turns) == ("", 0)
    assert [m.content for m in record.pending] == ["The capital of France?"]


def test_a_turn_whose_session_ended_before_it_ran_fails_not_found(clean_redis_url):
    stages = RecordingStages()

    async def scenario(redis, store, session_id):
        jobs = JobStore(redis, ttl_s=60)
        record = await store.begin_turn(session_id, "job-1")
        request = turn_request(record, session_pb2.GenerateStreamRequest())
        await jobs.create("job-1", request, 5, session_id=session_id)
        await store.end(session_id)
        pipeline = Pipeline(
            jobs, stages, engine_retries=0, fleet=preparation_pb2.GetCapacityResponse, turns=Turns(store)
        )
        return await pipeline.run(JobRun(await jobs.get("job-1")))

    result = _session(clean_redis_url, scenario)
    assert result.status == common_pb2.JOB_STATUS_FAILED and failure_code(result) is grpc.StatusCode.NOT_FOUND
    assert stages.plans == [] and stages.prepares == []


def test_a_turn_after_a_given_turn_appends_only_while_that_turn_is_the_latest(clean_redis_url):
    """A Responses API continuation (`after_turn`): its messages become the turn's input in the same
    transaction; once the session moved on (another turn, a running one, input appended) nothing is
    appended and NotLatest says so."""
    stages = RecordingStages()
    follow_up = [common_pb2.ChatMessage(role="user", content="And of Italy?")]

    async def scenario(redis, store, session_id):
        await _turn(redis, stages, store, session_id, "job-1")
        outcomes = []
        for after_turn in (0, 2):  # an older turn, a turn not answered yet
            with pytest.raises(NotLatest):
                await store.begin_turn(session_id, "job-x", messages=follow_up, after_turn=after_turn)
        outcomes.append(await store.get(session_id))
        record = await store.begin_turn(session_id, "job-2", messages=follow_up, after_turn=1)
        outcomes.append(record)
        with pytest.raises(NotLatest):  # job-2 runs: a sibling continuation of turn 1 cannot append
            await store.begin_turn(session_id, "job-3", messages=follow_up, after_turn=1)
        outcomes.append(await store.get(session_id))
        return outcomes

    untouched, begun, running = _session(clean_redis_url, scenario)
    assert (untouched.turns, untouched.job_id, list(untouched.pending)) == (1, "", [])
    assert begun.job_id == "job-2" and [m.content for m in begun.turn_input] == ["And of Italy?"]
    assert turn_messages(begun) == list(begun.turn_input)  # a later turn's job carries only its input
    assert running.job_id == "job-2" and list(running.pending) == []
