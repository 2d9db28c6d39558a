"""Post-processing of one job (docs/design.md#post-processing): validate the output, record the
metrics, send feedback to the router. It holds no resource of the job: reception gives the engine
slot back when the generation ends."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from libs.feedback import FEEDBACK_STREAM, entry_fields
from libs.gen.expert.v1 import common_pb2, postproc_pb2
from libs.job_results import job_result
from libs.logging import get_logger
from libs.response_format import to_structured
from libs.timestamps import timestamp
from services.postproc.metrics import PostprocMetrics
from services.postproc.validation import Validation, validate_calls, validate_output

log = get_logger(__name__)


Publish = Callable[[str, dict[str, bytes]], Awaitable[None]]


class Finalizer:
    def __init__(self, publish: Publish, metrics: PostprocMetrics) -> None:
        self.publish = publish  # XADDs to a Redis stream
        self.metrics = metrics

    async def finalize(self, request: postproc_pb2.FinalizeRequest) -> common_pb2.InferenceResult:
        """The job's result: its output validated, its metrics recorded, feedback sent to the router."""
        started = time.perf_counter()
        outcome = request.outcome
        validations = _validate(request)
        validation = validations[0]
        total_ms = (
            (time.time() - request.submitted_at.ToDatetime().timestamp()) * 1000
            if request.HasField("submitted_at")
            else 0.0
        )
        result = job_result(
            request.job_id,
            outcome,
            timed_out=request.timed_out,
            cancelled=request.cancelled,
            latency_ms=total_ms,
            trace=request.reasoning_trace,
            dropped_experts=request.dropped_experts,
        )
        metrics = _metrics(request, result, total_ms, passed=all(v.valid for v in validations))
        await self.publish(FEEDBACK_STREAM, entry_fields(_feedback(request, metrics, validation.validator)))
        metrics.postproc_latency_ms = (time.perf_counter() - started) * 1000
        self.metrics.observe(metrics, result.status, validation.validator)
        log.info(
            "job finalized",
            job_id=request.job_id,
            status=common_pb2.JobStatus.Name(result.status),
            validation=metrics.validation_passed,
            tokens=outcome.completion_tokens,
            total_ms=round(total_ms, 1),
        )
        result.validation.CopyFrom(_proto(validation))
        for choice, checked in zip(result.choices, validations, strict=False):
            choice.validation.CopyFrom(_proto(checked))
        result.metrics.CopyFrom(metrics)
        return result


def _validate(request: postproc_pb2.FinalizeRequest) -> list[Validation]:
    """Each choice validated; the result's own validation is the first choice's, and the job passes
    (for the metrics and the routers' feedback) when every choice does."""
    outcome = request.outcome
    output_format = to_structured(request.response_format)
    task_type = _task_type(request)
    return [
        validate_calls(c.tool_calls)
        if c.tool_calls
        else validate_output(c.text, task_type, output_format, cut_by_max_tokens=_cut(c.finish_reason))
        for c in outcome.choices
    ] or [
        validate_output(outcome.text, task_type, output_format, cut_by_max_tokens=_cut(outcome.finish_reason))
    ]


def _metrics(
    request: postproc_pb2.FinalizeRequest, result: common_pb2.InferenceResult, total_ms: float, passed: bool
) -> common_pb2.InferenceMetrics:
    """The job's metrics, but for postproc's own latency."""
    outcome = request.outcome
    experts = list(result.experts_used)
    usage = outcome.usage
    decode_s = usage.decode_ms / 1000
    return common_pb2.InferenceMetrics(
        job_id=request.job_id,
        submitted_at=request.submitted_at,
        router_latency_ms=request.router_latency_ms,
        expert_load_latency_ms=request.preparation_latency_ms,
        inference_latency_ms=request.inference_latency_ms,
        total_latency_ms=total_ms,
        experts_used=experts,
        num_experts=len(experts),
        vram_peak_mb=request.kv_bytes_needed // (1 << 20),
        input_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        output_tokens=outcome.completion_tokens,
        tokens_per_second=(outcome.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0,
        success=result.status == common_pb2.JOB_STATUS_COMPLETED,
        error=outcome.error,
        validation_passed=passed,
        queue_latency_ms=request.queue_latency_ms,
        ttft_ms=usage.ttft_ms,
        reception_latency_ms=request.reception_latency_ms,
        draft_tokens=usage.draft_tokens,
        accepted_draft_tokens=usage.accepted_draft_tokens,
    )


def _feedback(
    request: postproc_pb2.FinalizeRequest, metrics: common_pb2.InferenceMetrics, validator: str
) -> common_pb2.FeedbackRecord:
    """The routers' feedback on the job's experts."""
    return common_pb2.FeedbackRecord(
        job_id=request.job_id,
        experts=metrics.experts_used,
        task_type=_task_type(request),
        success=metrics.success,
        validation_passed=metrics.validation_passed,
        validator=validator,
        latency_ms=metrics.total_latency_ms,
        finished_at=timestamp(time.time()),
    )


def _task_type(request: postproc_pb2.FinalizeRequest) -> str:
    return request.task_type or "general"


def _cut(finish_reason: int) -> bool:
    return finish_reason == common_pb2.FINISH_REASON_LENGTH


def _proto(validation: Validation) -> common_pb2.ValidationResult:
    return common_pb2.ValidationResult(
        valid=validation.valid, validator=validation.validator, error=validation.error
    )
