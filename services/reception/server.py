"""InferenceService: reception's public API (the reception stage).

Admission — validation, normalization, the job record and the enqueue — happens in the call; the
rest of the pipeline runs in a dispatcher, and Infer / InferStream follow the job's event stream in
Redis, so any reception instance can answer for a job any dispatcher runs. A client that hangs up
cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from libs.auth.limits import KeyLimiter
from libs.auth.policy import Access, current_caller, methods
from libs.errors import ServiceError, invalid_argument, invalid_arguments, is_client_error, not_found
from libs.gen.expert.v1 import common_pb2, inference_pb2
from libs.job_results import failure_code
from libs.logging import bind_context, get_logger
from libs.timestamps import timestamp
from services.reception.capacity import Capacity, served_model
from services.reception.jobs import FINAL, JobExpired, JobStore
from services.reception.metrics import ReceptionMetrics
from services.reception.queue import JobQueue, stream
from services.reception.validation import validate

log = get_logger(__name__)

SERVICE = "expert.v1.InferenceService"
# Every call of the public API needs an API key (any scope) when auth is on.
ACCESS = methods(
    SERVICE, {name: Access.INFER for name in ("Infer", "InferStream", "Submit", "GetJob", "CancelJob")}
)
DEFAULT_PRIORITY = 5
MAX_JOB_ID_CHARS = 64  # ids are 32 hex digits; anything much longer is not worth a Redis lookup


class Undecodable:
    """A request that did not parse (e.g. a string field that is not UTF-8)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class ReceptionServicer:
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
        self.limiter = limiter  # the per-key limits; None: none enforced
        self.queue = queue
        self.capacity = capacity
        self.metrics = metrics
        self.average_job_s = average_job_s  # for estimated_wait_ms, refined as jobs finish
        self._background: set[asyncio.Task] = set()
        self._stopping = False

    def observe_job(self, seconds: float) -> None:
        """Fold a finished job's duration into the average behind estimated_wait_ms."""
        self.average_job_s += 0.1 * (seconds - self.average_job_s)

    async def _model(self, request: common_pb2.InferenceRequest) -> common_pb2.ServedModel | None:
        """The model the request runs on, for validation (its context window). The dispatcher
        keeps the capacity fresh, so admission uses the latest answer and asks preparation only
        when it knows no model yet."""
        capacity = self.capacity.last if self.capacity.last.models else await self.capacity.get()
        return served_model(capacity, request)

    async def _admit(
        self,
        request: common_pb2.InferenceRequest | Undecodable,
        streaming: bool = False,
        *,
        job_id: str | None = None,
        session_id: str = "",
    ) -> tuple[str, float, int]:
        started = time.perf_counter()
        # The caller the credentials proved (gRPC interceptor or HTTP front); None with auth off.
        caller = current_caller()
        if self.limiter is not None:
            await self.limiter.admit(caller)  # first: a key over its limit costs no more work
        if isinstance(request, Undecodable):
            raise invalid_argument(
                "request", f"not a valid request message ({request.reason}); text fields must be valid UTF-8"
            )
        try:
            model = await self._model(request)  # a call to preparation only before its first answer
            started_work = time.perf_counter()
            validate(request, model.max_model_len if model is not None else 0)
        except ServiceError as exc:
            for field, _ in exc.violations:
                self.metrics.rejected.labels(field.split("[")[0]).inc()
            raise
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
        admission = time.perf_counter() - started
        self.metrics.submitted.labels(str(priority)).inc()
        self.metrics.admission.observe(admission)
        log.info("job submitted", job_id=job_id, priority=priority)
        return job_id, submitted_at, priority

    async def Submit(
        self, request: inference_pb2.SubmitRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SubmitResponse:
        return inference_pb2.SubmitResponse(submission=await self.submit(_inner(request)))

    async def submit(self, request: common_pb2.InferenceRequest | Undecodable) -> common_pb2.JobSubmission:
        """Admit a job and return at once: Submit, for every front (gRPC and HTTP)."""
        job_id, submitted_at, priority = await self._admit(request)
        return await self._submission(job_id, submitted_at, priority)

    async def _submission(self, job_id: str, submitted_at: float, priority: int) -> common_pb2.JobSubmission:
        ahead = await self.queue.depth_at_or_above(priority)
        slots = max(1, (await self.capacity.get()).free_slots)
        return common_pb2.JobSubmission(
            job_id=job_id,
            status=common_pb2.JOB_STATUS_QUEUED,
            submitted_at=timestamp(submitted_at),
            estimated_wait_ms=int(max(0, ahead - 1) * self.average_job_s / slots * 1000),
        )

    async def Infer(
        self, request: inference_pb2.InferRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.InferResponse:
        return inference_pb2.InferResponse(result=await self.infer(_inner(request)))

    async def InferStream(
        self, request: inference_pb2.InferStreamRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.InferStreamResponse]:
        async with contextlib.aclosing(self.infer_stream(_inner(request))) as messages:
            async for message in messages:
                yield message

    async def infer(self, request: common_pb2.InferenceRequest | Undecodable) -> common_pb2.InferenceResult:
        """Admit a job and wait for its result: Infer, for every front (gRPC and HTTP). Cancelled
        (the caller went away), it cancels the job; a ServiceError is the refusal to send."""
        job_id, _, _ = await self._admit(request)
        with bind_context(job_id=job_id):
            try:
                async for kind, fields in self._events(job_id, result_only=True):
                    if kind == b"result":
                        result = common_pb2.InferenceResult.FromString(fields[b"result"])
                        _raise_client_error(result)
                        return result
            except asyncio.CancelledError:
                self._cancel_in_background(job_id)
                raise
        raise ServiceError(grpc.StatusCode.INTERNAL, f"job {job_id} ended without a result")

    async def infer_stream(
        self, request: common_pb2.InferenceRequest | Undecodable
    ) -> AsyncIterator[inference_pb2.InferStreamResponse]:
        """Admit a job and follow it: InferStream's messages, for every front (gRPC and HTTP).
        Closed or cancelled before the result (the caller went away), it cancels the job."""
        job_id, submitted_at, priority = await self._admit(request, streaming=True)
        finished = False
        try:
            yield inference_pb2.InferStreamResponse(
                submitted=await self._submission(job_id, submitted_at, priority)
            )
            async for kind, fields in self._events(job_id):
                if kind == b"delta":
                    delta = common_pb2.ChoiceDelta.FromString(fields[b"delta"])
                    yield inference_pb2.InferStreamResponse(delta=delta)
                elif kind == b"status":
                    yield inference_pb2.InferStreamResponse(status=int(fields[b"status"]))
                elif kind == b"restart":
                    yield inference_pb2.InferStreamResponse(restarted_attempt=int(fields[b"attempt"]))
                elif kind == b"result":
                    finished = True
                    result = common_pb2.InferenceResult.FromString(fields[b"result"])
                    _raise_client_error(result)
                    yield inference_pb2.InferStreamResponse(result=result)
                    return
        finally:
            if not finished:  # the client went away (or we failed): do not leave the job running
                self._cancel_in_background(job_id)

    async def _events(
        self, job_id: str, *, result_only: bool = False
    ) -> AsyncIterator[tuple[bytes, dict[bytes, bytes]]]:
        try:
            async for event in self.jobs.follow(job_id, result_only=result_only):
                yield event
        except JobExpired:
            raise not_found(f"job {job_id} expired") from None

    async def GetJob(
        self, request: inference_pb2.GetJobRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetJobResponse:
        return inference_pb2.GetJobResponse(job=await self.get_job(_job_id(request)))

    async def get_job(self, job_id: str) -> common_pb2.Job:
        """A job's record: GetJob, for every front (gRPC and HTTP)."""
        return await self._job(job_id)

    async def _job(self, job_id: str) -> common_pb2.Job:
        if not job_id:
            raise invalid_argument("job_id", "must not be empty")
        if len(job_id) > MAX_JOB_ID_CHARS:
            raise invalid_argument("job_id", f"at most {MAX_JOB_ID_CHARS} characters, got {len(job_id)}")
        record = await self.jobs.get(job_id)
        if record is None:
            raise not_found(f"job {job_id!r} does not exist (or expired)")
        return record.to_proto(await self.jobs.text(job_id))

    async def CancelJob(
        self, request: inference_pb2.CancelJobRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CancelJobResponse:
        return inference_pb2.CancelJobResponse(job=await self.cancel_job(_job_id(request)))

    async def cancel_job(self, job_id: str) -> common_pb2.Job:
        """Stop a job and return its record as read right after: CancelJob, for every front."""
        job = await self._job(job_id)
        await self._cancel(job)
        return await self._job(job.job_id)

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

    def stop_following(self) -> None:
        """Reception is stopping: the calls still following jobs are about to be cut off, which
        is not their clients hanging up, so their jobs are left to run (another reception's
        dispatcher takes over the ones this one hands back)."""
        self._stopping = True

    def _cancel_in_background(self, job_id: str) -> None:
        if self._stopping:
            return

        async def cancel() -> None:
            await self._cancel(await self._job(job_id))

        self._in_background(cancel(), job_id)

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


def _inner(request: object) -> common_pb2.InferenceRequest | Undecodable:
    return request if isinstance(request, Undecodable) else request.request


def _job_id(request: object) -> str:
    if isinstance(request, Undecodable):
        raise invalid_argument(
            "job_id", f"not a valid request message ({request.reason}); it must be valid UTF-8"
        )
    return request.job_id


def _raise_client_error(result: common_pb2.InferenceResult) -> None:
    """A job refused by a stage (e.g. an unknown forced expert) fails the call with that refusal."""
    code = failure_code(result)
    if result.status == common_pb2.JOB_STATUS_FAILED and code is not None and is_client_error(code):
        if result.error_fields:
            raise invalid_arguments([(f.field, f.description) for f in result.error_fields])
        raise ServiceError(code, result.error)


def tolerant(message: type) -> object:
    """A request deserializer that turns a parse failure into an Undecodable instead of an INTERNAL."""

    def deserialize(data: bytes) -> object:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


def add_to_server(servicer: ReceptionServicer, server: grpc.aio.Server) -> str:
    """Register the servicer with tolerant deserializers (so bad UTF-8 is INVALID_ARGUMENT)."""
    handlers = {
        "Infer": grpc.unary_unary_rpc_method_handler(
            servicer.Infer,
            tolerant(inference_pb2.InferRequest),
            inference_pb2.InferResponse.SerializeToString,
        ),
        "InferStream": grpc.unary_stream_rpc_method_handler(
            servicer.InferStream,
            tolerant(inference_pb2.InferStreamRequest),
            inference_pb2.InferStreamResponse.SerializeToString,
        ),
        "Submit": grpc.unary_unary_rpc_method_handler(
            servicer.Submit,
            tolerant(inference_pb2.SubmitRequest),
            inference_pb2.SubmitResponse.SerializeToString,
        ),
        "GetJob": grpc.unary_unary_rpc_method_handler(
            servicer.GetJob,
            tolerant(inference_pb2.GetJobRequest),
            inference_pb2.GetJobResponse.SerializeToString,
        ),
        "CancelJob": grpc.unary_unary_rpc_method_handler(
            servicer.CancelJob,
            tolerant(inference_pb2.CancelJobRequest),
            inference_pb2.CancelJobResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    return SERVICE
