"""Test doubles of the reception's InferenceService and of PreparationService, served in-process.

They exist to test the client side only — the SDK's and `expertctl`'s translation between Python
and the protos, over a real gRPC connection — while the real reception is not written yet. Their
behaviour is predictable by design:

- Infer, InferStream and Submit record the `InferenceRequest` they got (`requests`) and refuse
  temperature > 2, priority > 9 and an empty prompt without messages with INVALID_ARGUMENT and a
  google.rpc.BadRequest detail (one violation per bad field, named "request.<field>").
- The result echoes the prompt: `text` is the prompt, `tokens_generated` its word count,
  `experts_used` the forced experts; with `n` or `logprobs` set, `choices` holds n echoes, each
  word a token of logprob -(its position + 1) with `logprobs` alternatives. A prompt starting
  with "fail" gives a failed job; a `timeout_ms` below 100 gives a timed-out job whose text is
  the prompt's first word.
  A prompt starting with "sleep" makes Infer wait 2 s first (for deadlines); one starting with
  "refuse" gives a job a stage refused: INVALID_ARGUMENT in `error_code`, a field in `error_fields`.
- InferStream sends `submitted`, a RUNNING status, the prompt word by word, then the result.
  With "restart" in the prompt it sends two words, `restarted_attempt=2`, then all words again.
  A prompt starting with "forever" streams "tick " until the client cancels (`stream_cancelled`).
- Submitted jobs ("job-1", ...) are completed with the echo result, except prompts starting with
  "slow", which stay running with their first word as partial text. GetJob and CancelJob answer
  NOT_FOUND (without details) for unknown ids.
- ListEngines returns `engines` (two sample engines unless told otherwise).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from libs.gen.expert.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    preparation_pb2,
    preparation_pb2_grpc,
)
from libs.job_results import set_failure
from tools.stack import free_port

SUBMITTED_AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
FINISHED_AT = SUBMITTED_AT + timedelta(seconds=1.5)
LATENCY_MS = 812.5
TRACE = "fake reception: echoed the prompt"
_MESSAGE_BYTES = 64 * 1024 * 1024


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    timestamp = timestamp_pb2.Timestamp()
    timestamp.FromDatetime(moment)
    return timestamp


def _abort_invalid(context: grpc.ServicerContext, violations: list[tuple[str, str]]) -> None:
    bad_request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
            for field, description in violations
        ]
    )
    detail = any_pb2.Any()
    detail.Pack(bad_request)
    status = status_pb2.Status(
        code=code_pb2.INVALID_ARGUMENT, message="the request has invalid fields", details=[detail]
    )
    context.abort_with_status(rpc_status.to_status(status))


def echo_result(job_id: str, request: common_pb2.InferenceRequest) -> common_pb2.InferenceResult:
    """The result the fake gives `request` (see the module docstring)."""
    words = request.prompt.split()
    result = common_pb2.InferenceResult(
        job_id=job_id,
        status=common_pb2.JOB_STATUS_COMPLETED,
        text=request.prompt,
        tokens_generated=len(words),
        experts_used=list(request.force_experts),
        latency_ms=LATENCY_MS,
        finish_reason=common_pb2.FINISH_REASON_STOP,
        validation=common_pb2.ValidationResult(valid=True, validator="generic"),
        reasoning_trace=TRACE,
        experts=[
            common_pb2.AppliedExpert(name=name, version="1.0.0", adapter_type="lora", weight=0.5)
            for name in request.force_experts
        ],
    )
    result.metrics.job_id = job_id
    result.metrics.submitted_at.CopyFrom(_timestamp(SUBMITTED_AT))
    result.metrics.total_latency_ms = LATENCY_MS
    result.metrics.output_tokens = len(words)
    result.metrics.experts_used.extend(request.force_experts)
    result.metrics.success = True
    if request.HasField("n") or request.HasField("logprobs"):
        for index in range(request.n or 1):
            choice = result.choices.add(
                index=index, text=request.prompt, finish_reason=common_pb2.FINISH_REASON_STOP
            )
            for i, word in enumerate(words if request.HasField("logprobs") else []):
                token = choice.logprobs.add(token=word, logprob=-(i + 1.0), token_bytes=word.encode())
                for k in range(request.logprobs):
                    token.top_logprobs.add(token=f"alt{k}", logprob=-(k + 0.5))
    if request.prompt.startswith("fail"):
        result.status = common_pb2.JOB_STATUS_FAILED
        result.finish_reason = common_pb2.FINISH_REASON_ERROR
        result.error = "the engine crashed"
        result.text = ""
    elif request.prompt.startswith("refuse"):
        result.status = common_pb2.JOB_STATUS_FAILED
        result.finish_reason = common_pb2.FINISH_REASON_ERROR
        result.error = "the router refused the job"
        refused = [("request.max_tokens", "exceeds the context window 2048")]
        set_failure(result, grpc.StatusCode.INVALID_ARGUMENT, refused)
        result.text = ""
    elif request.HasField("timeout_ms") and request.timeout_ms < 100:
        result.status = common_pb2.JOB_STATUS_TIMED_OUT
        result.finish_reason = common_pb2.FINISH_REASON_TIMEOUT
        result.timed_out = True
        result.text = words[0] if words else ""
    return result


class FakeInferenceService(inference_pb2_grpc.InferenceServiceServicer):
    """InferenceService with the predictable behaviour of the module docstring."""

    def __init__(self) -> None:
        self.requests: list[common_pb2.InferenceRequest] = []
        self.jobs: dict[str, common_pb2.Job] = {}
        self.stream_cancelled = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def last_request(self) -> common_pb2.InferenceRequest:
        return self.requests[-1]

    def _accept(self, request: common_pb2.InferenceRequest, context: grpc.ServicerContext) -> str:
        with self._lock:
            self.requests.append(request)
            job_id = f"job-{next(self._ids)}"
        violations = []
        if not request.prompt and not request.messages:
            violations.append(("request.prompt", "required unless messages are given"))
        if request.HasField("temperature") and request.temperature > 2:
            violations.append(("request.temperature", f"must be in [0, 2], got {request.temperature:g}"))
        if request.HasField("priority") and request.priority > 9:
            violations.append(("request.priority", f"must be in [0, 9], got {request.priority}"))
        if violations:
            _abort_invalid(context, violations)
        return job_id

    def Infer(self, request, context):
        job_id = self._accept(request.request, context)
        if request.request.prompt.startswith("sleep"):
            time.sleep(2)
        return inference_pb2.InferResponse(result=echo_result(job_id, request.request))

    def InferStream(self, request, context):
        job_id = self._accept(request.request, context)
        prompt = request.request.prompt
        submission = common_pb2.JobSubmission(
            job_id=job_id, status=common_pb2.JOB_STATUS_QUEUED, submitted_at=_timestamp(SUBMITTED_AT)
        )
        yield inference_pb2.InferStreamResponse(submitted=submission)
        yield inference_pb2.InferStreamResponse(status=common_pb2.JOB_STATUS_RUNNING)
        if prompt.startswith("forever"):
            # This stream never ends by itself: the call ends only when the client cancels it.
            context.add_callback(self.stream_cancelled.set)
            while context.is_active():
                yield inference_pb2.InferStreamResponse(delta=common_pb2.ChoiceDelta(text="tick "))
                time.sleep(0.02)
            return
        pieces = prompt.split(" ")
        pieces = [piece + " " for piece in pieces[:-1]] + pieces[-1:]
        if "restart" in prompt:
            for piece in pieces[:2]:
                yield inference_pb2.InferStreamResponse(delta=common_pb2.ChoiceDelta(text=piece))
            yield inference_pb2.InferStreamResponse(restarted_attempt=2)
        for piece in pieces:
            yield inference_pb2.InferStreamResponse(delta=common_pb2.ChoiceDelta(text=piece))
        yield inference_pb2.InferStreamResponse(result=echo_result(job_id, request.request))

    def Submit(self, request, context):
        job_id = self._accept(request.request, context)
        job = common_pb2.Job(
            job_id=job_id,
            submitted_at=_timestamp(SUBMITTED_AT),
            updated_at=_timestamp(SUBMITTED_AT),
            priority=request.request.priority if request.request.HasField("priority") else 5,
            attempts=1,
        )
        if request.request.prompt.startswith("slow"):
            job.status = common_pb2.JOB_STATUS_RUNNING
            job.text = request.request.prompt.split()[0]
        else:
            job.status = common_pb2.JOB_STATUS_COMPLETED
            job.result.CopyFrom(echo_result(job_id, request.request))
            job.text = job.result.text
            job.finished_at.CopyFrom(_timestamp(FINISHED_AT))
        with self._lock:
            self.jobs[job_id] = job
        submission = common_pb2.JobSubmission(
            job_id=job_id,
            status=common_pb2.JOB_STATUS_QUEUED,
            submitted_at=_timestamp(SUBMITTED_AT),
            estimated_wait_ms=1500,
        )
        return inference_pb2.SubmitResponse(submission=submission)

    def _job(self, job_id: str, context: grpc.ServicerContext) -> common_pb2.Job:
        with self._lock:
            job = self.jobs.get(job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {job_id!r} not found")
        return job

    def GetJob(self, request, context):
        return inference_pb2.GetJobResponse(job=self._job(request.job_id, context))

    def CancelJob(self, request, context):
        job = self._job(request.job_id, context)
        if job.status < common_pb2.JOB_STATUS_COMPLETED:
            job.status = common_pb2.JOB_STATUS_CANCELLED
            job.finished_at.CopyFrom(_timestamp(FINISHED_AT))
        return inference_pb2.CancelJobResponse(job=job)


def sample_engines(now: datetime | None = None) -> list[common_pb2.EngineInfo]:
    """Two engines, the first heard from 2 s before `now`, the second never."""
    now = now or datetime.now(UTC)
    model = common_pb2.ModelSpec(
        name="SmolLM2-135M-Instruct",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        max_model_len=2048,
        sampling_defaults=common_pb2.SamplingDefaults(temperature=0.7, top_k=20),
    )
    return [
        common_pb2.EngineInfo(
            engine_id="engine-a",
            address="10.0.0.5:50054",
            model=model,
            load=common_pb2.EngineLoad(
                kv_blocks_total=2048, kv_blocks_free=1500, running=3, waiting=1, max_num_seqs=16
            ),
            active_jobs=4,
            registered_at=_timestamp(now - timedelta(minutes=5)),
            last_heartbeat=_timestamp(now - timedelta(seconds=2)),
        ),
        common_pb2.EngineInfo(
            engine_id="engine-b",
            address="10.0.0.6:50054",
            model=model,
            load=common_pb2.EngineLoad(kv_blocks_total=512, kv_blocks_free=512, max_num_seqs=8),
        ),
    ]


class FakePreparationService(preparation_pb2_grpc.PreparationServiceServicer):
    """PreparationService whose ListEngines returns `engines`; the other methods are not served."""

    def __init__(self, engines: list[common_pb2.EngineInfo] | None = None) -> None:
        self.engines = sample_engines() if engines is None else engines

    def ListEngines(self, request, context):
        return preparation_pb2.ListEnginesResponse(engines=self.engines)


@dataclass
class FakeServer:
    target: str
    reception: FakeInferenceService
    preparation: FakePreparationService


@contextlib.contextmanager
def serve_fakes() -> Iterator[FakeServer]:
    """Both fakes on one gRPC server at 127.0.0.1 on a free port, for the duration of the block."""
    reception = FakeInferenceService()
    preparation = FakePreparationService()
    options = [
        ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ("grpc.max_receive_message_length", _MESSAGE_BYTES),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(reception, server)
    preparation_pb2_grpc.add_PreparationServiceServicer_to_server(preparation, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield FakeServer(f"127.0.0.1:{port}", reception, preparation)
    finally:
        server.stop(grace=None)


def unused_port() -> int:
    """A port nothing listens on (free when asked; nothing binds it in these tests)."""
    return free_port()
