"""The job saga (`services/reception/dispatch/pipeline.py`) against stages in memory: no gRPC server, a real
Redis for the job records. Whatever ends a job (a stage down or refusing, an engine dying, a cancel
or a timeout at any stage, the dispatcher shutting down), every successful placement is released
exactly once, and a job never placed is never released."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from redis.asyncio import Redis

from libs.errors import CLIENT_ERRORS
from libs.gen.expert.v1 import common_pb2, engine_pb2, preparation_pb2
from libs.job_results import failure_code
from services.reception.capacity import Capacity
from services.reception.dispatch.dispatcher import Dispatcher, DispatchSettings
from services.reception.dispatch.pipeline import Pipeline
from services.reception.dispatch.run import JobRun
from services.reception.jobs import JobStore, job_key
from services.reception.metrics import ReceptionMetrics
from services.reception.queue import DEAD_LETTER, GROUP, JobQueue, stream
from tests.helpers.in_process import shared_metrics

STAGES = ("plan", "prepare", "generate", "finalize")


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeStream:
    """An engine's Generate stream: `script` is "complete", "die" (UNAVAILABLE after one chunk),
    "hang" (one chunk, then nothing until it is aborted or cancelled) or a status code (that error
    after one chunk). A request resumed after the first chunk's token (`resume_token_ids`) goes on
    after it, as the engine does."""

    def __init__(self, script: str | grpc.StatusCode, resume: list[int] | None = None) -> None:
        self.script = script
        self.resume = resume or []
        self.aborted = asyncio.Event()
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        self.aborted.set()
        return True

    async def __aiter__(self):
        if self.resume not in ([], [1]):
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"resume_token_ids: {self.resume}")
        if not self.resume:
            yield engine_pb2.GenerateResponse(text="Par", token_ids=[1])
        if self.script == "die":
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "engine gone")
        if isinstance(self.script, grpc.StatusCode):
            raise rpc_error(self.script, "the engine refused the request")
        if self.script == "hang":
            await self.aborted.wait()
            if self.cancelled:
                raise asyncio.CancelledError
            yield engine_pb2.GenerateResponse(
                finish_reason=common_pb2.FINISH_REASON_ABORT, usage=common_pb2.GenerationUsage()
            )
            return
        yield engine_pb2.GenerateResponse(
            text="is",
            token_ids=[2],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.GenerationUsage(),  # the last message: every choice finished
        )


class FakeStages:
    """The other stages in memory. `hang` names a stage that waits until `unblock` is set; `errors`
    maps a stage to the error it raises; `engines` is the script of each placement's stream, in
    order. Counts every placement and release per job."""

    def __init__(
        self,
        *,
        hang: str | None = None,
        errors: dict[str, grpc.aio.AioRpcError] | None = None,
        engines: tuple[str | grpc.StatusCode, ...] = ("complete",),
    ) -> None:
        self.hang = hang
        self.errors = errors or {}
        self.engines = list(engines)
        self.reached = {stage: asyncio.Event() for stage in STAGES}
        self.unblock = asyncio.Event()
        self.placements: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()
        self.streams: list[FakeStream] = []

    async def _enter(self, stage: str) -> None:
        self.reached[stage].set()
        if self.hang == stage:
            await self.unblock.wait()
        if stage in self.errors:
            raise self.errors[stage]

    async def plan(self, request, timeout):
        await self._enter("plan")
        return common_pb2.ExpertPlan(model_input=common_pb2.ModelInput(text=request.request.prompt))

    async def prepare(self, request, timeout):
        await self._enter("prepare")
        self.placements[request.job_id] += 1
        n = self.placements[request.job_id]
        return common_pb2.Placement(engine_id=f"engine-{n}", address=f"engine-{n}:1")

    async def release(self, job_id):
        self.releases[job_id] += 1

    async def generate(self, address, request, timeout):
        await self._enter("generate")
        stream = FakeStream(
            self.engines.pop(0) if self.engines else "complete", list(request.resume_token_ids)
        )
        self.streams.append(stream)
        return stream

    async def abort(self, address, request_id, timeout):
        self.streams[-1].aborted.set()

    async def finalize(self, request, timeout):
        await self._enter("finalize")
        status = (
            common_pb2.JOB_STATUS_CANCELLED
            if request.cancelled
            else common_pb2.JOB_STATUS_TIMED_OUT
            if request.timed_out
            else common_pb2.JOB_STATUS_FAILED
            if request.outcome.error
            else common_pb2.JOB_STATUS_COMPLETED
        )
        return common_pb2.InferenceResult(
            job_id=request.job_id, status=status, text=request.outcome.text, error=request.outcome.error
        )


async def start(redis_url: str, stages: FakeStages, *, timeout_ms: int | None = None, retries: int = 0):
    redis = Redis.from_url(redis_url)
    jobs = JobStore(redis, ttl_s=60)
    request = common_pb2.InferenceRequest(prompt="What is the capital of France?", max_tokens=8)
    if timeout_ms is not None:
        request.timeout_ms = timeout_ms
    await jobs.create("job-1", request, 5)
    run = JobRun(await jobs.get("job-1"))
    saga = Pipeline(
        jobs,
        stages,
        engine_retries=retries,
        fleet=lambda: preparation_pb2.GetCapacityResponse(
            models=[common_pb2.ServedModel(name="tiny", max_model_len=1024)]
        ),
        place_retry_s=0.01,
    )
    return redis, run, asyncio.create_task(saga.run(run))


def run_saga(redis_url: str, stages: FakeStages, act=None, **options) -> common_pb2.InferenceResult | str:
    """Run job-1 through the saga; `act(run, task)` intervenes while it runs. The result, or
    "cancelled" when the task itself was cancelled (a dispatcher shutting down)."""

    async def main():
        redis, run, task = await start(redis_url, stages, **options)
        try:
            if act is not None:
                await act(run, task)
            try:
                return await asyncio.wait_for(task, 10)
            except asyncio.CancelledError:
                return "cancelled"
        finally:
            await redis.aclose()

    return asyncio.run(main())


def assert_one_release_per_placement(stages: FakeStages, placements: int) -> None:
    assert stages.placements["job-1"] == placements
    assert stages.releases["job-1"] == placements


def test_a_completed_job_releases_its_one_placement(clean_redis_url):
    stages = FakeStages()
    result = run_saga(clean_redis_url, stages)
    assert (result.status, result.text) == (common_pb2.JOB_STATUS_COMPLETED, "Paris")
    assert_one_release_per_placement(stages, 1)


def test_router_down_fails_the_job_and_releases_nothing(clean_redis_url):
    stages = FakeStages(errors={"plan": rpc_error(grpc.StatusCode.UNAVAILABLE, "router down")})
    result = run_saga(clean_redis_url, stages)
    assert result.status == common_pb2.JOB_STATUS_FAILED and "router down" in result.error
    assert_one_release_per_placement(stages, 0)


def test_preparation_refusing_fails_the_job_and_releases_nothing(clean_redis_url):
    stages = FakeStages(errors={"prepare": rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "too big")})
    result = run_saga(clean_redis_url, stages)
    assert result.status == common_pb2.JOB_STATUS_FAILED and "too big" in result.error
    assert_one_release_per_placement(stages, 0)


def test_an_engine_dying_mid_stream_releases_it_before_the_job_is_placed_again(clean_redis_url):
    stages = FakeStages(engines=("die", "complete"))
    result = run_saga(clean_redis_url, stages, retries=1)
    assert (result.status, result.text) == (common_pb2.JOB_STATUS_COMPLETED, "Paris")  # "Par" once
    assert_one_release_per_placement(stages, 2)
    assert [s.resume for s in stages.streams] == [[], [1]]  # the new run went on after "Par"


def test_an_engine_dying_with_no_retry_left_fails_the_job_and_releases_it(clean_redis_url):
    stages = FakeStages(engines=("die",))
    result = run_saga(clean_redis_url, stages, retries=0)
    assert result.status == common_pb2.JOB_STATUS_FAILED and "engine-1" in result.error
    assert_one_release_per_placement(stages, 1)


@pytest.mark.parametrize("code", sorted(CLIENT_ERRORS, key=lambda c: c.value[0]), ids=lambda c: c.name)
def test_an_engine_refusing_with_a_client_error_fails_the_job_with_that_code_on_no_other_engine(
    clean_redis_url, code
):
    """libs.errors.is_client_error: the request is wrong, not the engine, so no retry elsewhere; and
    reception's Infer answers with the code the result records (tests/unit/test_job_failures.py)."""
    stages = FakeStages(engines=(code, "complete"))
    result = run_saga(clean_redis_url, stages, retries=1)
    assert result.status == common_pb2.JOB_STATUS_FAILED and "refused the request" in result.error
    assert (failure_code(result), result.error_code) == (code, code.name)
    assert_one_release_per_placement(stages, 1)


def test_postproc_down_records_the_output_unvalidated_and_releases_once(clean_redis_url):
    stages = FakeStages(errors={"finalize": rpc_error(grpc.StatusCode.UNAVAILABLE, "postproc down")})
    result = run_saga(clean_redis_url, stages)
    assert (result.status, result.text) == (common_pb2.JOB_STATUS_COMPLETED, "Paris")
    assert "postproc" in result.error and not result.HasField("validation")
    assert result.validation_skipped  # marked in the API (and counted, ReceptionMetrics.finished)
    assert_one_release_per_placement(stages, 1)


# The placements a job holds when a cancel, a timeout or a shutdown lands while it is in `stage`.
HELD = {"plan": 0, "prepare": 1, "generate": 1, "finalize": 1}


def hang_in(stage: str) -> FakeStages:
    # An engine that streams until stopped stands for a generation still running.
    if stage == "generate":
        return FakeStages(engines=("hang",))
    return FakeStages(hang=stage)


@pytest.mark.parametrize("stage", STAGES)
def test_a_cancel_at_each_stage_releases_what_was_placed(clean_redis_url, stage):
    stages = hang_in(stage)

    async def cancel(run, task):
        await stages.reached[stage].wait()
        run.cancel.set()
        await asyncio.sleep(0.05)
        # A Prepare in flight lands after the stop (its slot is the job's all the same); Finalize
        # is not raced against a cancel.
        stages.unblock.set()

    result = run_saga(clean_redis_url, stages, cancel)
    if stage != "finalize":  # a cancel during finalization comes after the job's final outcome
        assert result.status == common_pb2.JOB_STATUS_CANCELLED
    assert_one_release_per_placement(stages, HELD[stage])


@pytest.mark.parametrize("stage", STAGES)
def test_a_timeout_at_each_stage_releases_what_was_placed(clean_redis_url, stage):
    stages = hang_in(stage)

    async def land_late(run, task):
        await stages.reached[stage].wait()
        await asyncio.sleep(0.4)  # past the deadline
        stages.unblock.set()

    result = run_saga(clean_redis_url, stages, land_late, timeout_ms=200)
    if stage != "finalize":
        assert result.status == common_pb2.JOB_STATUS_TIMED_OUT
    assert_one_release_per_placement(stages, HELD[stage])


@pytest.mark.parametrize("stage", ["plan", "prepare", "generate"])
def test_a_dispatcher_shutting_down_releases_what_was_placed(clean_redis_url, stage):
    stages = hang_in(stage)

    async def shut_down(run, task):
        await stages.reached[stage].wait()
        task.cancel()
        await asyncio.sleep(0.05)
        stages.unblock.set()  # a Prepare in flight lands during the shutdown

    assert run_saga(clean_redis_url, stages, shut_down) == "cancelled"
    assert_one_release_per_placement(stages, HELD[stage])


def test_a_prepare_whose_answer_was_lost_is_released_since_preparation_may_hold_the_slot(clean_redis_url):
    stages = FakeStages(errors={"prepare": rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")})
    result = run_saga(clean_redis_url, stages)
    assert result.status == common_pb2.JOB_STATUS_FAILED
    assert (stages.placements["job-1"], stages.releases["job-1"]) == (0, 1)


def test_a_job_cancelled_just_before_it_is_placed_gives_the_placement_back(clean_redis_url):
    """CancelJob ends the record while the job is planned; the placement that follows is noticed as
    the PREPARING status is refused, and given back."""
    stages = FakeStages(hang="plan")

    async def cancel_job(run, task):
        await stages.reached["plan"].wait()
        redis = Redis.from_url(clean_redis_url)
        cancelled = common_pb2.InferenceResult(job_id="job-1", status=common_pb2.JOB_STATUS_CANCELLED)
        assert await JobStore(redis, ttl_s=60).finish("job-1", cancelled)
        await redis.aclose()
        stages.unblock.set()

    result = run_saga(clean_redis_url, stages, cancel_job)
    assert result.status == common_pb2.JOB_STATUS_CANCELLED
    assert_one_release_per_placement(stages, 1)


class _FreeSlots:
    """Preparation's GetCapacity in memory: always room."""

    async def GetCapacity(self, request, timeout=None, metadata=None):
        return preparation_pb2.GetCapacityResponse(free_slots=4)


def test_a_job_its_dispatchers_kept_dying_on_is_dead_lettered_and_ends_failed(clean_redis_url):
    """Past EXPERT_DISPATCH_MAX_DELIVERIES the dispatcher does not run the job again: the entry goes
    to the dead-letter stream with where it came from, its deliveries and the reason, and the job
    ends FAILED saying why. Nothing is placed, so nothing is released."""

    async def scenario():
        redis = Redis.from_url(clean_redis_url)
        jobs, stages = JobStore(redis, ttl_s=60), FakeStages()
        queue = JobQueue(redis)
        await queue.setup()
        await jobs.create("poison", common_pb2.InferenceRequest(prompt="hi", max_tokens=4), 5, stream(5))
        await redis.hset(job_key("poison"), "deliveries", 3)  # three dispatchers died running it
        pipeline = Pipeline(
            jobs,
            stages,
            engine_retries=0,
            fleet=lambda: preparation_pb2.GetCapacityResponse(
                models=[common_pb2.ServedModel(name="tiny", max_model_len=1024)]
            ),
        )
        settings = DispatchSettings(
            max_jobs=1, reclaim_idle_ms=60_000, max_deliveries=3, default_timeout_s=None
        )
        dispatcher = Dispatcher(
            redis, jobs, queue, pipeline, Capacity(_FreeSlots()), settings, shared_metrics(ReceptionMetrics)
        )
        await dispatcher.start()
        try:
            for _ in range(200):
                record = await jobs.get("poison")
                if record.final:
                    break
                await asyncio.sleep(0.05)
        finally:
            await dispatcher.stop()
        ((_id, fields),) = await redis.xrange(DEAD_LETTER)
        pending = (await redis.xpending(stream(5), GROUP))["pending"]
        await redis.aclose()
        return record, fields, pending, stages

    record, fields, pending, stages = asyncio.run(scenario())
    assert record.status == common_pb2.JOB_STATUS_FAILED
    assert record.result.error == "gave up after 3 deliveries (its dispatchers kept dying)"
    assert fields[b"job_id"] == b"poison" and fields[b"source_stream"] == stream(5).encode()
    assert fields[b"deliveries"] == b"3" and fields[b"reason"] == record.result.error.encode()
    assert b"source_id" in fields and pending == 0
    assert not stages.placements and not stages.releases and not stages.reached["plan"].is_set()


class ExpiringStages(FakeStages):
    """A stage whose call runs out of the time it was given, as a gRPC call does: it waits out its
    timeout (the job's remaining time) and raises DEADLINE_EXCEEDED, a little before the pipeline's
    own timer fires (gRPC keeps its own clock)."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.expiring = stage

    async def _deadline(self, timeout):
        await asyncio.sleep(max(0.0, timeout - 0.02))
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    async def plan(self, request, timeout):
        if self.expiring == "plan":
            await self._deadline(timeout)
        return await super().plan(request, timeout)

    async def prepare(self, request, timeout):
        if self.expiring == "prepare":
            await self._deadline(timeout)
        return await super().prepare(request, timeout)


@pytest.mark.parametrize("stage", ["plan", "prepare"])
def test_a_stage_running_out_of_the_jobs_time_ends_it_timed_out_not_failed(clean_redis_url, stage):
    """Under load the router once answered "Deadline Exceeded" and the job was FAILED."""
    stages = ExpiringStages(stage)
    result = run_saga(clean_redis_url, stages, timeout_ms=200)
    assert result.status == common_pb2.JOB_STATUS_TIMED_OUT, result
    assert stages.releases["job-1"] == (1 if stage == "prepare" else 0)  # a lost Prepare may hold a slot


def test_a_deadline_exceeded_before_the_jobs_deadline_is_a_failure(clean_redis_url):
    stages = FakeStages(errors={"plan": rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "router slow")})
    result = run_saga(clean_redis_url, stages, timeout_ms=60_000)
    assert (result.status, result.error_code) == (common_pb2.JOB_STATUS_FAILED, "DEADLINE_EXCEEDED")


class _Slots:
    """Preparation's capacity: `free` slots, fewer as jobs are placed (FakeStages counts them)."""

    def __init__(self, total: int, stages: FakeStages) -> None:
        self.total, self.stages = total, stages

    async def GetCapacity(self, request, timeout=None, metadata=None):
        held = sum(self.stages.placements.values()) - sum(self.stages.releases.values())
        return preparation_pb2.GetCapacityResponse(free_slots=self.total - held)


@pytest.mark.parametrize(("slots", "max_jobs", "running"), [(40, 1024, 40), (5, 1024, 5), (40, 12, 12)])
def test_the_dispatcher_runs_as_many_jobs_as_the_fleet_has_free_slots(
    clean_redis_url, slots, max_jobs, running
):
    """With 40 jobs queued whose generation hangs, the jobs in progress follow the fleet's free
    slots (no fixed number of workers), bounded by EXPERT_DISPATCH_MAX_JOBS; once the generations
    end, every job completes and every slot comes back."""

    async def scenario():
        redis = Redis.from_url(clean_redis_url)
        jobs, stages = JobStore(redis, ttl_s=60), FakeStages(hang="generate")
        queue = JobQueue(redis)
        await queue.setup()
        for i in range(40):
            await jobs.create(
                f"job-{i}", common_pb2.InferenceRequest(prompt="hi", max_tokens=4), 5, stream(5)
            )
        pipeline = Pipeline(
            jobs,
            stages,
            engine_retries=0,
            fleet=lambda: preparation_pb2.GetCapacityResponse(
                models=[common_pb2.ServedModel(name="tiny", max_model_len=1024)]
            ),
        )
        settings = DispatchSettings(
            max_jobs=max_jobs, reclaim_idle_ms=60_000, max_deliveries=3, default_timeout_s=None
        )
        capacity = Capacity(_Slots(slots, stages), ttl_s=0.0)
        dispatcher = Dispatcher(
            redis, jobs, queue, pipeline, capacity, settings, shared_metrics(ReceptionMetrics)
        )
        await dispatcher.start()
        try:
            await asyncio.sleep(1.5)  # long enough to take every job it may
            in_progress = sum(stages.placements.values())
            stages.unblock.set()
            for _ in range(400):
                records = [await jobs.get(f"job-{i}") for i in range(40)]
                if all(r.final for r in records):
                    break
                await asyncio.sleep(0.05)
        finally:
            await dispatcher.stop()
        await redis.aclose()
        return in_progress, records, stages

    in_progress, records, stages = asyncio.run(scenario())
    assert in_progress == running
    assert [r.status for r in records] == [common_pb2.JOB_STATUS_COMPLETED] * 40
    assert stages.releases == stages.placements


class RestartingEngine(FakeStages):
    """The job's engine dies mid-stream; preparation then knows no engine (UNAVAILABLE) for
    `down` Prepare calls, until the engine's new process registers under the same id."""

    def __init__(self, down: int) -> None:
        super().__init__(engines=("die", "complete"))
        self.down = down
        self.requests: list[preparation_pb2.PrepareRequest] = []
        self.request_ids: list[str] = []

    async def prepare(self, request, timeout):
        self.requests.append(request)
        if self.placements[request.job_id] and self.down:  # the engine is down after its first run
            self.down -= 1
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "no engine is registered")
        self.placements[request.job_id] += 1
        instance = f"process-{self.placements[request.job_id]}"
        return common_pb2.Placement(engine_id="engine", address="engine:1", engine_instance_id=instance)

    async def generate(self, address, request, timeout):
        self.request_ids.append(request.request_id)
        return await super().generate(address, request, timeout)


def test_a_job_whose_engine_died_waits_for_its_restart_and_completes_as_a_new_attempt(clean_redis_url):
    """No other engine: the job waits (within its deadline) rather than fail, names the dead
    process to preparation (which drops it at once) in its first Prepare after the loss and in no
    other (preparation would drop the process again each time it registered), and runs on the
    engine's new process under a new engine request id, going on from the token its followers
    already have."""
    stages = RestartingEngine(down=3)
    result = run_saga(clean_redis_url, stages, retries=1, timeout_ms=10_000)
    assert (result.status, result.text) == (common_pb2.JOB_STATUS_COMPLETED, "Paris"), result.error
    assert_one_release_per_placement(stages, 2)
    reported = [[(e.engine_id, e.instance_id) for e in r.lost_engines] for r in stages.requests]
    assert reported == [[], [("engine", "process-1")], [], [], []]
    assert len(stages.request_ids) == 2 and len(set(stages.request_ids)) == 2

    async def attempts():
        redis = Redis.from_url(clean_redis_url)
        try:
            return (await JobStore(redis, ttl_s=60).get("job-1")).attempts
        finally:
            await redis.aclose()

    assert asyncio.run(attempts()) == 1  # the restart (the dispatcher, absent here, counts the first)


def test_a_job_whose_engine_never_comes_back_times_out_at_its_deadline(clean_redis_url):
    stages = RestartingEngine(down=10_000)
    result = run_saga(clean_redis_url, stages, retries=1, timeout_ms=1_500)
    assert result.status == common_pb2.JOB_STATUS_TIMED_OUT, result.error
    assert_one_release_per_placement(stages, 1)
