"""What the SDK returns: plain frozen dataclasses built from the service's protobufs.

Enums become lower-case strings without their prefix (JOB_STATUS_TIMED_OUT -> "timed_out",
FINISH_REASON_STOP -> "stop"), timestamps become timezone-aware UTC datetimes (None when unset),
repeated fields become tuples, and a message the server left unset becomes None.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from google.protobuf import timestamp_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from ._proto.expert.v1 import common_pb2
from .tools import ToolCall, ToolCallDelta, tool_call_from_proto

JobStatusName = Literal[
    "unspecified",
    "queued",
    "planning",
    "preparing",
    "running",
    "postprocessing",
    "completed",
    "failed",
    "cancelled",
    "timed_out",
]
FinishReasonName = Literal["unspecified", "stop", "length", "abort", "timeout", "error", "tool_calls"]

FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "timed_out"})


def _enum_names(enum: EnumTypeWrapper, prefix: str) -> dict[int, str]:
    return {value.number: value.name.removeprefix(prefix).lower() for value in enum.DESCRIPTOR.values}


_JOB_STATUS = _enum_names(common_pb2.JobStatus, "JOB_STATUS_")
_FINISH_REASON = _enum_names(common_pb2.FinishReason, "FINISH_REASON_")


def job_status_name(value: int) -> str:
    """ "completed" for JOB_STATUS_COMPLETED; the number as text for a value newer than this SDK."""
    return _JOB_STATUS.get(value, str(value))


def finish_reason_name(value: int) -> str:
    """ "stop" for FINISH_REASON_STOP; the number as text for a value newer than this SDK."""
    return _FINISH_REASON.get(value, str(value))


def _datetime(message, field: str) -> datetime | None:
    if not message.HasField(field):
        return None
    timestamp: timestamp_pb2.Timestamp = getattr(message, field)
    return timestamp.ToDatetime(tzinfo=UTC)


@dataclass(frozen=True)
class AppliedExpert:
    """An expert the engine applied to the job."""

    name: str
    version: str
    adapter_type: str
    weight: float


@dataclass(frozen=True)
class ValidationResult:
    """Postproc's check of the output (`validator`: json_schema, regex or grammar with a format;
    json, python or generic without)."""

    valid: bool
    validator: str
    error: str


@dataclass(frozen=True)
class InferenceMetrics:
    """Where the job's time went (milliseconds) and what it used."""

    job_id: str
    submitted_at: datetime | None
    reception_latency_ms: float
    queue_latency_ms: float
    router_latency_ms: float
    expert_load_latency_ms: float
    inference_latency_ms: float
    ttft_ms: float
    postproc_latency_ms: float
    total_latency_ms: float
    experts_used: tuple[str, ...]
    num_experts: int
    vram_peak_mb: int
    input_tokens: int
    output_tokens: int
    tokens_per_second: float
    success: bool
    error: str
    validation_passed: bool
    cached_tokens: int = 0  # of input_tokens, those the engine's prefix cache held


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and its position's most likely tokens (most likely first)."""

    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top_logprobs: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class Choice:
    """One of a job's n outputs; `logprobs` is empty unless the request asked for them."""

    index: int
    text: str
    finish_reason: FinishReasonName
    tokens_generated: int
    logprobs: tuple[TokenLogprob, ...]
    validation: ValidationResult | None
    # The calls the choice made (finish_reason "tool_calls"); empty for a text answer.
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class InferenceResult:
    """A finished job. When `timed_out`, `text` is the partial output produced before timeout_ms.
    A job a stage refused has `error_code` (a gRPC code name such as "INVALID_ARGUMENT") and, for
    bad fields, `error_fields` as (field, description) pairs. `choices` holds every output (n of
    them); `text`, `finish_reason` and `validation` are the first one's."""

    job_id: str
    status: JobStatusName
    text: str
    tokens_generated: int
    experts_used: tuple[str, ...]
    latency_ms: float
    finish_reason: FinishReasonName
    timed_out: bool
    validation: ValidationResult | None
    metrics: InferenceMetrics | None
    reasoning_trace: str
    error: str
    experts: tuple[AppliedExpert, ...]
    error_code: str
    error_fields: tuple[tuple[str, str], ...]
    # Experts the plan chose that preparation dropped to fit the engine's budget.
    dropped_experts: tuple[str, ...] = ()
    # The base model that answered ("" when the job ended before planning).
    model: str = ""
    choices: tuple[Choice, ...] = ()
    # Postproc could not be reached before the job's deadline: the output is as the engine made it,
    # not validated (`validation` is None).
    validation_skipped: bool = False


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed job: new text of choice `index` (and its tokens' logprobs, when asked
    for), or new pieces of its tool calls (`tool_calls`: ToolCallDelta). `restarted` chunks carry
    no text: the job started over (attempt number `attempt`) and everything received before is
    void."""

    text: str
    restarted: bool = False
    attempt: int = 0
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    # With tools the model may call: the pieces of the choice's calls these tokens made known
    # (a call's markup is never text).
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class JobSubmission:
    """A queued job."""

    job_id: str
    status: JobStatusName
    submitted_at: datetime | None
    estimated_wait_ms: int


@dataclass(frozen=True)
class Job:
    """A job's record: `text` is the output so far; `result` is set once the job is final."""

    job_id: str
    status: JobStatusName
    submitted_at: datetime | None
    updated_at: datetime | None
    finished_at: datetime | None
    priority: int
    attempts: int
    text: str
    result: InferenceResult | None
    error: str

    @property
    def is_finished(self) -> bool:
        return self.status in FINAL_STATUSES


def applied_expert_from_proto(message: common_pb2.AppliedExpert) -> AppliedExpert:
    return AppliedExpert(message.name, message.version, message.adapter_type, message.weight)


def validation_from_proto(message: common_pb2.ValidationResult) -> ValidationResult:
    return ValidationResult(message.valid, message.validator, message.error)


def metrics_from_proto(message: common_pb2.InferenceMetrics) -> InferenceMetrics:
    return InferenceMetrics(
        job_id=message.job_id,
        submitted_at=_datetime(message, "submitted_at"),
        reception_latency_ms=message.reception_latency_ms,
        queue_latency_ms=message.queue_latency_ms,
        router_latency_ms=message.router_latency_ms,
        expert_load_latency_ms=message.expert_load_latency_ms,
        inference_latency_ms=message.inference_latency_ms,
        ttft_ms=message.ttft_ms,
        postproc_latency_ms=message.postproc_latency_ms,
        total_latency_ms=message.total_latency_ms,
        experts_used=tuple(message.experts_used),
        num_experts=message.num_experts,
        vram_peak_mb=message.vram_peak_mb,
        input_tokens=message.input_tokens,
        output_tokens=message.output_tokens,
        tokens_per_second=message.tokens_per_second,
        success=message.success,
        error=message.error,
        validation_passed=message.validation_passed,
        cached_tokens=message.cached_tokens,
    )


def token_logprob_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        message.token_id,
        message.token,
        message.logprob,
        message.token_bytes,
        tuple(TopLogprob(t.token_id, t.token, t.logprob, t.token_bytes) for t in message.top_logprobs),
    )


def choice_from_proto(message: common_pb2.Choice) -> Choice:
    return Choice(
        index=message.index,
        text=message.text,
        finish_reason=finish_reason_name(message.finish_reason),
        tokens_generated=message.tokens_generated,
        logprobs=tuple(token_logprob_from_proto(t) for t in message.logprobs),
        validation=validation_from_proto(message.validation) if message.HasField("validation") else None,
        tool_calls=tuple(tool_call_from_proto(c) for c in message.tool_calls),
    )


def result_from_proto(message: common_pb2.InferenceResult) -> InferenceResult:
    return InferenceResult(
        job_id=message.job_id,
        status=job_status_name(message.status),
        text=message.text,
        tokens_generated=message.tokens_generated,
        experts_used=tuple(message.experts_used),
        latency_ms=message.latency_ms,
        finish_reason=finish_reason_name(message.finish_reason),
        timed_out=message.timed_out,
        validation=validation_from_proto(message.validation) if message.HasField("validation") else None,
        metrics=metrics_from_proto(message.metrics) if message.HasField("metrics") else None,
        reasoning_trace=message.reasoning_trace,
        error=message.error,
        experts=tuple(applied_expert_from_proto(e) for e in message.experts),
        error_code=message.error_code,
        error_fields=tuple((f.field, f.description) for f in message.error_fields),
        dropped_experts=tuple(message.dropped_experts),
        model=message.model,
        choices=tuple(choice_from_proto(c) for c in message.choices),
        validation_skipped=message.validation_skipped,
    )


def submission_from_proto(message: common_pb2.JobSubmission) -> JobSubmission:
    return JobSubmission(
        job_id=message.job_id,
        status=job_status_name(message.status),
        submitted_at=_datetime(message, "submitted_at"),
        estimated_wait_ms=message.estimated_wait_ms,
    )


def job_from_proto(message: common_pb2.Job) -> Job:
    return Job(
        job_id=message.job_id,
        status=job_status_name(message.status),
        submitted_at=_datetime(message, "submitted_at"),
        updated_at=_datetime(message, "updated_at"),
        finished_at=_datetime(message, "finished_at"),
        priority=message.priority,
        attempts=message.attempts,
        text=message.text,
        result=result_from_proto(message.result) if message.HasField("result") else None,
        error=message.error,
    )
