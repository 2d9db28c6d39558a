"""Admission: what reception does with a request before and after the dispatcher runs it, for every
front (the gRPC InferenceService and SessionService, the HTTP API's OpenAI and REST routes).

It mints the job id, applies the caller's per-key limits, validates and normalizes the request
(validation.py), writes the job's record and enqueues it in one step, estimates the wait, follows
the job's events (job_events.py) and cancels it. It knows no gRPC servicer: a refusal is a
`libs.errors.ServiceError` with its status code, which each front answers in its own terms, as
KServe's servicers adapt protobuf to a data plane that knows no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from libs.auth.limits import KeyLimiter
from libs.auth.policy import current_caller
from libs.errors import ServiceError, invalid_argument, invalid_arguments, is_client_error, not_found
from libs.gen.expert.v1 import common_pb2
from libs.job_results import failure_code
from libs.logging import bind_context, get_logger
from libs.timestamps import timestamp
from services.reception.admission.validation import validate
from services.reception.capacity import Capacity, served_model
from services.reception.job_events import Finished, JobEvent
from services.reception.jobs import FINAL, JobExpired, JobStore
from services.reception.metrics import REFUSED_RATE, ReceptionMetrics
from services.reception.queue import JobQueue, stream

log = get_logger(__name__)

DEFAULT_PRIORITY = 5
MAX_JOB_ID_CHARS = 64  # ids are 32 hex digits; anything much longer is not worth a Redis lookup
HANDED_BACK_RETRY_S = 1.0  # another reception answers at once (behind the same load balancer)
# The job a call waits on in `result`, for a front that must answer the call without it: a stop that
# cuts the call off names the job to follow elsewhere (http/calls.py).
AWAITED_JOB: ContextVar[str | None] = ContextVar("expert_awaited_job", default=None)


class Undecodable:
    """A request that did not parse (e.g. a string field that is not UTF-8): a front hands it to
    admission as it is, which refuses it once the caller's limits are applied."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class JobHandedBack(ServiceError):
    """Reception stopped while a call followed the job: the job carries on (another reception's
    dispatcher runs it), and the caller is told its id to follow it there, and when to come back."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"this reception is stopping; job {job_id} carries on: follow it on another one "
            f"(GetJob, GET /v1/jobs/{job_id})",
            retry_after_s=HANDED_BACK_RETRY_S,
        )
        self.job_id = job_id


@dataclass(frozen=True)
class Admitted:
    """A job admission wrote and enqueued."""

    job_id: str
    submitted_at: float  # seconds since the epoch
    priority: int


@dataclass(frozen=True)
class Submitted:
    """The first event of a followed job (`Admission.stream`): its id and estimated wait."""

    submission: common_pb2.JobSubmission


class Admission:
    """The admission core. `limiter` enforces the per-key limits (None: none enforced)."""

    def __init__(
        self,
        jobs: JobStore,
        queue: JobQueue,
        capacity: Capacity,
        metrics: ReceptionMetrics,
        average_job_s: float = 1.0,
        limiter: KeyLimiter | None = None,
    ) -> None:
        self.jobs = jobs
        self.limiter = limiter
        self.queue = queue
        self.capacity = capacity
        self.metrics = metrics
        self.average_job_s = average_job_s  # for estimated_wait_ms, refined as jobs finish
        self._background: set[asyncio.Task] = set()
        self._stopping = False
        self._handed_back = asyncio.Event()  # set once the drain is over (hand_back_followers)

    def observe_job(self, seconds: float) -> None:
        """Fold a finished job's duration into the average behind estimated_wait_ms."""
        self.average_job_s += 0.1 * (seconds - self.average_job_s)

    # -- admitting a job ---------------------------------------------------------------------------

    async def admit(
        self,
        request: common_pb2.InferenceRequest | Undecodable,
        *,
        streaming: bool = False,
        job_id: str | None = None,
        session_id: str = "",
    ) -> Admitted:
        """Make the request a job: the caller's limits, validation, the record and the enqueue.
        `streaming` says a client shows its tokens as they come; `job_id` and `session_id` are a
        session turn's (its id is minted here otherwise). Raises the refusal as a ServiceError."""
        started = time.perf_counter()
        # The caller the credentials proved (gRPC interceptor or HTTP front); None with auth off.
        caller = current_caller()
        if self.limiter is not None:
            try:
                await self.limiter.admit(caller)  # first: a key over its limit costs no more work
            except ServiceError as exc:
                if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.metrics.refused(REFUSED_RATE)
                raise
        if isinstance(request, Undecodable):
            raise invalid_argument(
                "request", f"not a valid request message ({request.reason}); text fields must be valid UTF-8"
            )
        started_work = await self._validated(request)
        priority = request.priority if request.HasField("priority") else DEFAULT_PRIORITY
        job_id = job_id or uuid.uuid4().hex
        # The reception stage ends here (validated, normalized, a job id): its time goes into the
        # job's metrics. The enqueue that follows is the queue's, and counts in its wait.
        reception_ms = (time.perf_counter() - started_work) * 1000
        submitted_at = await self.jobs.create(
            job_id,
            request,
            priority,
            queue=stream(priority),
            reception_ms=reception_ms,
            streaming=streaming,
            key_id=caller.key_id if caller is not None else None,
            session_id=session_id,
        )
        admission_s = time.perf_counter() - started
        self.metrics.submitted.labels(str(priority)).inc()
        self.metrics.admission.observe(admission_s)
        log.info("job submitted", job_id=job_id, priority=priority)
        return Admitted(job_id, submitted_at, priority)

    async def _validated(self, request: common_pb2.InferenceRequest) -> float:
        """Validate and normalize the request in place against its model's context window, counting
        each refused field; returns when the validation started (perf_counter)."""
        try:
            model = await self._model(request)  # a call to preparation only before its first answer
            started = time.perf_counter()
            validate(request, model.max_model_len if model is not None else 0)
        except ServiceError as exc:
            for field, _ in exc.violations:
                self.metrics.refused(field)
            raise
        return started

    async def _model(self, request: common_pb2.InferenceRequest) -> common_pb2.ServedModel | None:
        """The model the request runs on, for validation (its context window). The dispatcher
        keeps the capacity fresh, so admission uses the latest answer and asks preparation only
        when it knows no model yet."""
        capacity = self.capacity.last if self.capacity.last.models else await self.capacity.get()
        return served_model(capacity, request)

    async def submission(self, admitted: Admitted) -> common_pb2.JobSubmission:
        """The job as just queued, with the wait estimated from the queue ahead of it."""
        ahead = await self.queue.depth_at_or_above(admitted.priority)
        slots = max(1, (await self.capacity.get()).free_slots)
        return common_pb2.JobSubmission(
            job_id=admitted.job_id,
            status=common_pb2.JOB_STATUS_QUEUED,
            submitted_at=timestamp(admitted.submitted_at),
            estimated_wait_ms=int(max(0, ahead - 1) * self.average_job_s / slots * 1000),
        )

    # -- the calls of the fronts -------------------------------------------------------------------

    async def submit(self, request: common_pb2.InferenceRequest | Undecodable) -> common_pb2.JobSubmission:
        """Admit a job and return at once (Submit, POST /v1/jobs)."""
        return await self.submission(await self.admit(request))

    async def infer(self, request: common_pb2.InferenceRequest | Undecodable) -> common_pb2.InferenceResult:
        """Admit a job and wait for its result (Infer, the non-streamed HTTP calls). Cancelled (the
        caller went away), it cancels the job; a job a stage refused raises that refusal."""
        return await self.result((await self.admit(request)).job_id)

    async def result(self, job_id: str) -> common_pb2.InferenceResult:
        """Wait for an admitted job's result, as `infer` does (a session's turn admitted elsewhere,
        answered over HTTP, waits here too)."""
        awaited = AWAITED_JOB.set(job_id)
        with bind_context(job_id=job_id):
            try:
                async for event in self.follow(job_id, result_only=True):
                    if isinstance(event, Finished):
                        raise_client_error(event.result)
                        return event.result
            except asyncio.CancelledError:
                self.cancel_in_background(job_id)
                raise
            finally:
                AWAITED_JOB.reset(awaited)
        raise ServiceError(grpc.StatusCode.INTERNAL, f"job {job_id} ended without a result")

    async def stream(
        self, request: common_pb2.InferenceRequest | Undecodable
    ) -> AsyncIterator[Submitted | JobEvent]:
        """Admit a job and follow it (InferStream, the streamed HTTP calls): `Submitted`, then the
        job's events up to its result. Closed or cancelled before the result (the caller went
        away), it cancels the job; a job a stage refused raises that refusal instead of its result."""
        admitted = await self.admit(request, streaming=True)
        async with contextlib.aclosing(self.followed(admitted)) as events:
            async for event in events:
                yield event

    async def followed(self, admitted: Admitted) -> AsyncIterator[Submitted | JobEvent]:
        """An admitted job as `stream` follows it (a session's turn admitted elsewhere, streamed
        over HTTP, is followed here too)."""
        finished = False
        try:
            yield Submitted(await self.submission(admitted))
            async for event in self.follow(admitted.job_id):
                if isinstance(event, Finished):
                    finished = True
                    raise_client_error(event.result)
                yield event
                if finished:
                    return
        finally:
            if not finished:  # the client went away (or we failed): do not leave the job running
                self.cancel_in_background(admitted.job_id)

    async def follow(self, job_id: str, *, result_only: bool = False) -> AsyncIterator[JobEvent]:
        """The job's events as JobStore.follow reads them; NOT_FOUND once its record expired, and
        JobHandedBack when reception's drain is over (hand_back_followers) while the job runs on."""
        events = self.jobs.follow(job_id, result_only=result_only)
        handed_back = asyncio.ensure_future(self._handed_back.wait())
        ended = False  # a job that ended in the drain answers its caller with its last events
        try:
            while True:
                step = asyncio.ensure_future(anext(events))
                try:
                    if not ended:
                        await asyncio.wait({step, handed_back}, return_when=asyncio.FIRST_COMPLETED)
                        if not step.done():
                            ended = await self.has_ended(job_id)
                            if not ended:
                                raise JobHandedBack(job_id)
                    event = await step
                except StopAsyncIteration:
                    return
                except JobExpired:
                    raise not_found(f"job {job_id} expired") from None
                finally:
                    if not step.done():  # handed back, or this call cancelled
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                yield event
        finally:
            handed_back.cancel()
            await events.aclose()

    async def get_job(self, job_id: str) -> common_pb2.Job:
        """A job's record (GetJob, GET /v1/jobs/{id}); NOT_FOUND when there is none."""
        if not job_id:
            raise invalid_argument("job_id", "must not be empty")
        if len(job_id) > MAX_JOB_ID_CHARS:
            raise invalid_argument("job_id", f"at most {MAX_JOB_ID_CHARS} characters, got {len(job_id)}")
        record = await self.jobs.get(job_id)
        if record is None:
            raise not_found(f"job {job_id!r} does not exist (or expired)")
        return record.to_proto(await self.jobs.text(job_id))

    async def has_ended(self, job_id: str) -> bool:
        """Whether the job is final, or gone (its record expired)."""
        record = await self.jobs.get(job_id)
        return record is None or record.final

    # -- cancelling --------------------------------------------------------------------------------

    async def cancel_job(self, job_id: str) -> common_pb2.Job:
        """Stop a job and return its record as read right after (CancelJob, DELETE /v1/jobs/{id})."""
        job = await self.get_job(job_id)
        await self._cancel(job)
        return await self.get_job(job.job_id)

    async def _cancel(self, job: common_pb2.Job) -> None:
        if job.status in FINAL:
            return
        if job.status == common_pb2.JOB_STATUS_QUEUED:
            # Not picked up yet: end it here (a dispatcher that picks it later sees it final).
            result = common_pb2.InferenceResult(
                job_id=job.job_id,
                status=common_pb2.JOB_STATUS_CANCELLED,
                finish_reason=common_pb2.FINISH_REASON_ABORT,
            )
            if await self.jobs.finish(job.job_id, result):
                return
        await self.jobs.request_cancel(job.job_id)

    def cancel_in_background(self, job_id: str) -> None:
        """Cancel the job without waiting (its caller went away); nothing while reception stops."""
        if self._stopping:
            return

        async def cancel() -> None:
            await self._cancel(await self.get_job(job_id))

        self._in_background(cancel(), job_id)

    def stop_following(self) -> None:
        """Reception is stopping: the calls still following jobs are about to be cut off, which
        is not their clients hanging up, so their jobs are left to run (another reception's
        dispatcher takes over the ones this one hands back)."""
        self._stopping = True

    def hand_back_followers(self) -> None:
        """The drain is over: each call still following a job ends now with JobHandedBack (its
        job's id), rather than being cut off without an answer when the server stops."""
        self._stopping = True
        self._handed_back.set()

    def _in_background(self, work: Coroutine[Any, Any, None], job_id: str = "") -> None:
        """Run `work` without waiting for it; a failure is logged, not lost."""

        async def guarded() -> None:
            try:
                await work
            except Exception:
                log.exception("background work for a job failed", job_id=job_id)

        task = asyncio.create_task(guarded())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def raise_client_error(result: common_pb2.InferenceResult) -> None:
    """A job refused by a stage (e.g. an unknown forced expert) fails the call with that refusal."""
    code = failure_code(result)
    if result.status == common_pb2.JOB_STATUS_FAILED and code is not None and is_client_error(code):
        if result.error_fields:
            raise invalid_arguments([(f.field, f.description) for f in result.error_fields])
        raise ServiceError(code, result.error)
