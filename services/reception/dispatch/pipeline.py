"""One job through the pipeline, a saga over the other stages (`stages.py`): plan, place, generate,
finalize. The job's turn policy (`turns.py`) supplies what differs for a turn of a session; the
saga is the same for every job.

Every stage runs against the job's deadline (submitted_at + timeout_ms) and its cancellation; either
stops the stage at once (an engine stream is cancelled, which aborts the engine request and frees
its KV) and the job is finalized with what it has: partial text and a timeout flag, or a cancelled
status. A job whose engine fails mid-stream waits for an engine again (preparation drops the dead
process at once; its restart may take the job) and runs as a new attempt that goes on from the
output tokens its readers already have: the engine takes them as the output's start and continues
exactly as the lost run would have (same positions, so greedy and seeded sampling give the same
tokens), and the readers see one output. A job with several choices, or a session's turn, starts
over from the prompt instead, with a restart event telling readers to discard the text so far.
Each placement has its own engine request id, so it never collides with a request of an earlier one
that an engine still runs.

The job owns an engine slot only inside `_placement`: the scope's exit is the one place the slot is
given back, whatever ended it (the generation's end, a lost engine, a cancel or timeout at any stage,
the dispatcher shutting down), so each successful placement is released exactly once. Whatever
happens, postproc finalizes the job (validation, metrics, feedback) and exactly one final result is
recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.errors import ServiceError, field_violations
from libs.gen.expert.v1 import common_pb2, engine_pb2, postproc_pb2, preparation_pb2, router_pb2
from libs.job_results import job_result, reasoning_trace, set_failure
from libs.logging import get_logger
from libs.timestamps import timestamp
from services.reception.capacity import served_model
from services.reception.dispatch.errors import EngineLost, JobFailed, JobStopped
from services.reception.dispatch.run import JobRun
from services.reception.dispatch.stages import GenerateStream, Stages
from services.reception.dispatch.turns import Turns
from services.reception.jobs import JobStore

log = get_logger(__name__)

_PLACE_LATER = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
# A Generate that ended with these never got an answer from the engine: the connection broke or the
# process went away (evidence about the engine, reported to preparation, which drops it). Any other
# status is the engine's answer (INTERNAL, RESOURCE_EXHAUSTED...): it is alive, and the job runs as
# a new attempt without the engine being reported.
_CHANNEL_BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
# A Prepare that ended with these may have reserved a slot before the answer was lost.
_OUTCOME_UNKNOWN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
DEFAULT_STREAM_INTERVAL = 16
# The engine ends a request at the job's deadline (or when asked to Abort it) and sends the text it
# has not sent yet; the call is given this long for that last message before it is cancelled
# outright (and that text is lost).
ENGINE_STOP_GRACE_S = 0.5
# How long postproc is waited for when it is down as a job ends: until the job's deadline, and at
# least this long (a job that timed out has no time left, and a restart takes seconds).
FINALIZE_MIN_WAIT_S = 10.0


class Pipeline:
    def __init__(
        self,
        jobs: JobStore,
        stages: Stages,
        engine_retries: int,
        fleet: Callable[[], preparation_pb2.GetCapacityResponse],
        place_retry_s: float = 0.05,
        stream_interval: int = DEFAULT_STREAM_INTERVAL,
        turns: Turns | None = None,
    ) -> None:
        self.jobs = jobs
        self.turns = turns or Turns()  # each job's turn policy (a session's turn, or a plain job)
        # Tokens per engine message for a job no client streams (a streamed job gets every token).
        self.stream_interval = stream_interval
        # The fleet as preparation last reported it: the models it serves (context window, sampling).
        self.fleet = fleet
        self.stages = stages
        self.engine_retries = engine_retries
        self.place_retry_s = place_retry_s

    async def run(self, run: JobRun) -> common_pb2.InferenceResult:
        """Take the job to its final state and return the result recorded for it."""
        outcome, timed_out, cancelled, failure = common_pb2.GenerationOutcome(), False, False, None
        try:
            run.turn = await self.turns.begin(run.record)  # first: a turn stopped at once still settles
            if run.cancel.is_set():
                raise JobStopped("cancelled")
            outcome = await self._stages(run)
        except JobStopped as stop:
            timed_out, cancelled = stop.reason == "timeout", stop.reason == "cancelled"
            outcome = run.choices.outcome()
        except JobFailed as exc:
            failure = exc
            outcome = run.choices.outcome()
            outcome.error = str(exc)
        except (RedisConnectionError, RedisTimeoutError):
            # The job's state could not be stored (Redis down longer than the store waits): it is
            # not failed for that. Its queue entry stays unacknowledged, so a dispatcher reclaims it
            # and runs it again once Redis is back; the saga has given its slot back meanwhile.
            log.warning("Redis unreachable: the job is left for a dispatcher to run again", job_id=run.job_id)
            raise
        except Exception as exc:  # a bug or an unreachable stage: fail this job, not the dispatcher
            log.exception("job failed", job_id=run.job_id)
            failure = JobFailed(f"{type(exc).__name__}: {exc}", grpc.StatusCode.INTERNAL)
            outcome = run.choices.outcome()
            outcome.error = str(failure)
        run.placed.set()
        result = await self._finalize(run, outcome, timed_out, cancelled)
        result.model = run.model
        if failure is not None:
            set_failure(result, failure.code, failure.fields)
        # Before the result is announced: a session is free for its next turn once it is.
        await run.turn.settle(result, run.plan, run.placement)
        await self.jobs.finish(run.job_id, result)
        return result

    async def _stages(self, run: JobRun) -> common_pb2.GenerationOutcome:
        # The dispatcher moved the job to PLANNING when it took it (JobStore.begin).
        run.plan = await self._plan(run)
        run.plan.prompt_bytes = run.turn.prompt_bytes(run.plan)
        return await self._place_and_generate(run)

    @contextlib.asynccontextmanager
    async def _status(self, run: JobRun, status: int) -> AsyncIterator[None]:
        """Announce `status` while the stage it names runs (the write is not on the job's path);
        once the stage is done, stop the job if it was finalized meanwhile (a CancelJob)."""
        write = asyncio.ensure_future(self.jobs.set_status(run.job_id, status))
        try:
            yield
        except BaseException:
            with contextlib.suppress(BaseException):
                await write
            raise
        if not await write:
            raise JobStopped("cancelled")

    # -- plan ----------------------------------------------------------------------------------------

    async def _plan(self, run: JobRun) -> common_pb2.ExpertPlan:
        """The job's plan, by its turn policy (the router's, or one the turn has); `run.model` is
        the model it runs on."""
        request = run.record.request
        try:
            model = served_model(self.fleet(), request)
        except ServiceError as exc:  # its model is no longer served
            raise JobFailed(exc.message, exc.code, list(exc.violations)) from None
        plan_request = router_pb2.PlanRequest(job_id=run.job_id, request=request)
        if model is not None:
            run.model = model.name
            plan_request.max_model_len = model.max_model_len
            plan_request.model_defaults.CopyFrom(model.sampling_defaults)
            plan_request.base_model_hash = model.base_model_hash
        else:  # no engine yet: placement waits for one serving the model asked for (or any)
            run.model = request.model
        return await run.turn.plan(lambda: self._route(run, plan_request), request)

    async def _route(self, run: JobRun, request: router_pb2.PlanRequest) -> common_pb2.ExpertPlan:
        try:
            return await run.until(self.stages.plan(request, run.remaining()))
        except grpc.aio.AioRpcError as exc:
            run.stop_if_expired(exc)
            raise JobFailed(f"router: {exc.details()}", exc.code(), field_violations(exc)) from None

    # -- place ---------------------------------------------------------------------------------------

    async def _place_and_generate(self, run: JobRun) -> common_pb2.GenerationOutcome:
        """Place the job and generate. When its engine is lost, the job waits for an engine again
        (any, the lost one's restarted process included: preparation drops the lost process at
        once) and runs as a new attempt (`_restart`), up to `engine_retries` times and within its
        deadline."""
        # The engine process the last attempt's stream broke on, reported once, in the next
        # attempt's first Prepare (see `_place`).
        lost: list[preparation_pb2.LostEngine] = []
        for failures in range(self.engine_retries + 1):  # every attempt counts against the budget
            try:
                async with (
                    self._placement(run, lost),
                    self._status(run, common_pb2.JOB_STATUS_RUNNING),
                ):
                    return await self._generate(run)
            except EngineLost as error:
                engine = run.placement.engine_id
                if failures == self.engine_retries:
                    raise JobFailed(f"engine {engine} failed: {error}", grpc.StatusCode.UNAVAILABLE) from None
                log.warning(
                    "engine lost: the job waits for an engine again"
                    if error.broken
                    else "the engine failed the job: it runs again as a new attempt",
                    engine=engine,
                    error=str(error),
                )
                lost = [_lost_engine(run.placement)] if error.broken else []
                await self._restart(run)
        raise AssertionError("unreachable")

    async def _restart(self, run: JobRun) -> None:
        """Start another attempt of the job: one that goes on from the output so far where it can
        (its followers see nothing of the change), else one from the prompt, whose followers are
        told to discard the text so far."""
        params = run.plan.generation_params
        resume = run.choices.resumable(max(params.n, params.best_of)) if run.turn.resumable else None
        if resume is None:
            run.choices.clear()
        run.resume = resume or []
        record = await self.jobs.begin(run.job_id, resume=resume is not None)
        run.attempt = record.attempts if record is not None else run.attempt + 1

    @contextlib.asynccontextmanager
    async def _placement(
        self, run: JobRun, lost: list[preparation_pb2.LostEngine]
    ) -> AsyncIterator[common_pb2.Placement]:
        """Place the job on an engine and hold the slot for the scope; its exit gives the slot back,
        and nothing else does."""
        placed = False
        try:
            async with self._status(run, common_pb2.JOB_STATUS_PREPARING):
                run.placement = await self._place(run, lost)
                placed = True
        except BaseException:  # a stop, a failure or a shutdown while the job was being placed
            # Placed, then stopped as the status was written (a CancelJob); or a Prepare that
            # reserved a slot all the same: either way the slot is the job's to give back.
            if placed or await self._landing(run):
                await self._give_back(run)
            raise
        run.placed.set()
        try:
            yield run.placement
        finally:
            await self._give_back(run)

    async def _landing(self, run: JobRun) -> bool:
        """Whether the Prepare still in flight when placing stopped may have reserved a slot, once
        it lands (it takes a millisecond; at most 5 s are given). A placement sets
        `run.placement`; a call that ran out of time or was cut off may have reserved one at
        preparation all the same."""
        prepare, run.preparing = run.preparing, None
        if prepare is None:
            return False
        try:
            run.placement = await asyncio.wait_for(asyncio.shield(prepare), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            return exc.code() in _OUTCOME_UNKNOWN
        except BaseException:  # no answer in time, or cancelled: preparation may hold the slot
            return True
        return True

    async def _give_back(self, run: JobRun) -> None:
        # Shielded: a dispatcher shutting down cancels the job's task, and the slot must still go back.
        await asyncio.shield(self.stages.release(run.job_id))

    async def _place(self, run: JobRun, lost: list[preparation_pb2.LostEngine]) -> common_pb2.Placement:
        request = preparation_pb2.PrepareRequest(job_id=run.job_id, plan=run.plan, model=run.model)
        run.turn.place(request)
        delay = self.place_retry_s
        # A loss goes in the first Prepare only. Sent again with every retry, it would make
        # preparation drop the same engine process each time it registered again after that drop
        # (alive all along), and the job would never find it.
        report = _with_lost(request, lost)
        while True:
            # Shielded and kept on the run: if the job is stopped while the call is in flight,
            # preparation may have reserved a slot already, and `_placement` waits for its answer.
            run.preparing = asyncio.ensure_future(self.stages.prepare(report, run.remaining()))
            report = request
            try:
                placement = await run.until(asyncio.shield(run.preparing))
                run.preparing = None
                return placement
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _OUTCOME_UNKNOWN:  # else `_placement` gives the slot back
                    run.preparing = None
                _raise_unless_later(run, exc)
            # no engine has room (or none is registered yet): wait for one, within the deadline
            await run.until(asyncio.sleep(delay))
            delay = min(delay * 2, 1.0)

    # -- generate ------------------------------------------------------------------------------------

    async def _generate(self, run: JobRun) -> common_pb2.GenerationOutcome:
        request = self._engine_request(run)
        address = run.placement.address
        remaining = run.remaining()
        stream = await self.stages.generate(
            address, request, None if remaining is None else remaining + ENGINE_STOP_GRACE_S
        )

        def abort() -> Awaitable[None]:
            # The engine stops the request and its stream ends with the text not yet sent.
            return self.stages.abort(address, request.request_id, ENGINE_STOP_GRACE_S)

        run.inference_started = time.time()
        try:
            # One race against the deadline and the cancellation for the whole stream, not one per
            # token: on a machine whose cores the model keeps busy, per-token work here is decode
            # time taken from the engine.
            final = await run.until(self._consume(run, stream), grace_s=ENGINE_STOP_GRACE_S, on_cancel=abort)
        except grpc.aio.AioRpcError as exc:
            run.stop_if_expired(exc)
            if run.turn.refuses(exc.code()):  # the request's fault (INVALID_ARGUMENT...): not the engine's
                raise JobFailed(f"engine: {exc.details()}", exc.code(), field_violations(exc)) from None
            broken = exc.code() in _CHANNEL_BROKEN
            raise EngineLost(f"{exc.code().name}: {exc.details()}", broken=broken) from None
        finally:
            stream.cancel()  # a no-op once the stream ended; otherwise it aborts the engine request
        return _outcome(run, final)

    def _engine_request(self, run: JobRun) -> engine_pb2.GenerateRequest:
        request = engine_pb2.GenerateRequest(
            # Unique per placement: an earlier run's request may still live on the engine (its
            # dispatcher lost Redis, or the engine has not seen the abort yet).
            request_id=f"{run.job_id}-{run.attempt}.{uuid.uuid4().hex[:8]}",
            params=run.plan.generation_params,
            experts=[
                common_pb2.ExpertRef(name=e.name, version=e.version, weight=e.weight)
                for e in run.placement.experts
            ],
            priority=run.record.priority,
            stream_interval=1 if run.record.streaming else self.stream_interval,
        )
        run.turn.engine_input(request, run.plan)
        request.resume_token_ids.extend(run.resume)
        if run.deadline is not None:
            request.deadline.CopyFrom(timestamp(run.deadline))
        return request

    async def _consume(self, run: JobRun, stream: GenerateStream) -> engine_pb2.GenerateResponse:
        """Read the engine's stream into the run's choices, announcing each delta; its last message
        (the one with usage: every choice finished), or an empty one if none came."""
        final = engine_pb2.GenerateResponse()
        async for response in stream:
            delta = run.choices.add(response)
            if delta is not None:
                await self.jobs.append_delta(run.job_id, delta)
            if response.HasField("usage"):  # the very last message: every choice finished
                final = response
                run.turn.confirm(response, run.choices)
        return final

    # -- finalize ------------------------------------------------------------------------------------

    async def _finalize(
        self, run: JobRun, outcome: common_pb2.GenerationOutcome, timed_out: bool, cancelled: bool
    ) -> common_pb2.InferenceResult:
        # Announced alongside the call: whatever the status write says, postproc runs (it records
        # the outcome), and finish() never overwrites a final status.
        announce = asyncio.ensure_future(
            self.jobs.set_status(run.job_id, common_pb2.JOB_STATUS_POSTPROCESSING)
        )
        wait_s = max(run.remaining() or 0.0, FINALIZE_MIN_WAIT_S)
        try:
            return await self.stages.finalize(_finalize_request(run, outcome, timed_out, cancelled), wait_s)
        except grpc.aio.AioRpcError as exc:
            # The output must not be lost because postproc stayed down: record it, marked unvalidated.
            log.error(
                "postproc failed; recording the result unvalidated", job_id=run.job_id, error=exc.details()
            )
            return _unvalidated(run, outcome, timed_out, cancelled, exc)
        finally:
            with contextlib.suppress(Exception):
                await announce  # before finish(), so the final status is the last one written


def _unvalidated(
    run: JobRun,
    outcome: common_pb2.GenerationOutcome,
    timed_out: bool,
    cancelled: bool,
    error: grpc.aio.AioRpcError,
) -> common_pb2.InferenceResult:
    """The job's result built by the same rules as postproc's, without validation, metrics or
    feedback, and marked so."""
    result = job_result(
        run.job_id,
        outcome,
        timed_out=timed_out,
        cancelled=cancelled,
        latency_ms=(time.time() - run.record.submitted_at) * 1000,
        trace=reasoning_trace(run.plan, run.placement),
        dropped_experts=run.placement.dropped_experts,
        error=outcome.error or f"postproc: {error.details()} (the output is not validated)",
    )
    result.validation_skipped = True
    return result


def _lost_engine(placement: common_pb2.Placement) -> preparation_pb2.LostEngine:
    return preparation_pb2.LostEngine(engine_id=placement.engine_id, instance_id=placement.engine_instance_id)


def _with_lost(
    request: preparation_pb2.PrepareRequest, lost: list[preparation_pb2.LostEngine]
) -> preparation_pb2.PrepareRequest:
    """`request` reporting `lost` (a copy: the retries send `request` without them)."""
    if not lost:
        return request
    report = preparation_pb2.PrepareRequest()
    report.CopyFrom(request)
    report.lost_engines.extend(lost)
    return report


def _raise_unless_later(run: JobRun, error: grpc.aio.AioRpcError) -> None:
    """A Prepare's error that fails the job (JobFailed), or stops it (its deadline passed); returns
    when the job is to be placed later: no engine has room yet, or none is registered (the job's
    engine died and its restart, or another engine, is waited for until the job's deadline)."""
    if error.code() not in _PLACE_LATER:
        run.stop_if_expired(error)
        raise JobFailed(f"preparation: {error.details()}", error.code(), field_violations(error)) from None


def _outcome(run: JobRun, final: engine_pb2.GenerateResponse) -> common_pb2.GenerationOutcome:
    """The generation's outcome from the engine's last message; a stream that ended without one
    lost its engine, and one the engine stopped at the deadline or on our Abort stops the job (the
    run's choices hold all it made)."""
    if not final.HasField("usage"):
        raise EngineLost("the stream ended without a final message")
    if final.finish_reason == common_pb2.FINISH_REASON_TIMEOUT:
        raise JobStopped("timeout")
    if final.finish_reason == common_pb2.FINISH_REASON_ABORT and run.cancel.is_set():
        raise JobStopped("cancelled")
    outcome = run.choices.outcome(final.finish_reason)
    outcome.usage.CopyFrom(final.usage)
    outcome.usage.completion_tokens += len(run.resume)  # made by the lost run, counted by this one
    outcome.experts.extend(final.experts)
    return outcome


def _finalize_request(
    run: JobRun, outcome: common_pb2.GenerationOutcome, timed_out: bool, cancelled: bool
) -> postproc_pb2.FinalizeRequest:
    """What postproc gets of the job: the outcome and the few facts its rules read."""
    inference_ms = (time.time() - run.inference_started) * 1000 if run.inference_started else 0.0
    return postproc_pb2.FinalizeRequest(
        job_id=run.job_id,
        outcome=outcome,
        submitted_at=timestamp(run.record.submitted_at),
        queue_latency_ms=(run.started - run.record.submitted_at) * 1000,
        reception_latency_ms=run.record.reception_ms,
        inference_latency_ms=inference_ms,
        timed_out=timed_out,
        cancelled=cancelled,
        task_type=run.plan.features.task_type or "general",
        # what the engine enforced; empty without a format, or when planning did not finish
        response_format=run.plan.generation_params.response_format,
        reasoning_trace=reasoning_trace(run.plan, run.placement),
        router_latency_ms=run.plan.router_latency_ms,
        preparation_latency_ms=run.placement.preparation_latency_ms,
        kv_bytes_needed=run.placement.kv_bytes_needed,
        dropped_experts=run.placement.dropped_experts,
    )
