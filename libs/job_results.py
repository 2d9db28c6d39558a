"""How a job's outcome becomes its result: the status rules and the result's fields. Postproc builds
every result with them (and adds the validation and the metrics); reception builds with the same
code the result it records unvalidated when postproc cannot be reached."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from libs.gen.expert.v1 import common_pb2

# ErrorCode numbers its values as gRPC numbers the codes of the same names.
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode if code is not grpc.StatusCode.OK}


def failed(outcome: common_pb2.GenerationOutcome, *, timed_out: bool, cancelled: bool) -> bool:
    """An error ends the job FAILED unless the job was stopped first (its error is the stop's)."""
    return bool(outcome.error) and not timed_out and not cancelled


def job_status(outcome: common_pb2.GenerationOutcome, *, timed_out: bool, cancelled: bool) -> int:
    if cancelled:
        return common_pb2.JOB_STATUS_CANCELLED
    if timed_out:
        return common_pb2.JOB_STATUS_TIMED_OUT
    if failed(outcome, timed_out=timed_out, cancelled=cancelled):
        return common_pb2.JOB_STATUS_FAILED
    return common_pb2.JOB_STATUS_COMPLETED


def finish_reason(outcome: common_pb2.GenerationOutcome, *, timed_out: bool, cancelled: bool) -> int:
    if timed_out:
        return common_pb2.FINISH_REASON_TIMEOUT
    if cancelled:
        return common_pb2.FINISH_REASON_ABORT
    if failed(outcome, timed_out=timed_out, cancelled=cancelled):
        return common_pb2.FINISH_REASON_ERROR
    return outcome.finish_reason


def reasoning_trace(plan: common_pb2.ExpertPlan, placement: common_pb2.Placement) -> str:
    """The router's reasons, then preparation's: where the job ran, what was staged or dropped."""
    return "\n".join(filter(None, [plan.reasoning_trace, *placement.trace]))


def job_result(
    job_id: str,
    outcome: common_pb2.GenerationOutcome,
    *,
    timed_out: bool,
    cancelled: bool,
    latency_ms: float,
    trace: str,
    dropped_experts: Sequence[str] = (),
    error: str | None = None,
) -> common_pb2.InferenceResult:
    """The result without validation or metrics; `error` defaults to the outcome's. A job that
    was stopped or failed ends each of its choices for that reason."""
    reason = finish_reason(outcome, timed_out=timed_out, cancelled=cancelled)
    stopped = reason != outcome.finish_reason
    choices = [
        common_pb2.Choice(
            index=c.index,
            text=c.text,
            finish_reason=reason if stopped or not c.finish_reason else c.finish_reason,
            tokens_generated=c.tokens_generated,
            logprobs=c.logprobs,
            tool_calls=[] if stopped else c.tool_calls,
        )
        for c in outcome.choices
    ]
    return common_pb2.InferenceResult(
        job_id=job_id,
        status=job_status(outcome, timed_out=timed_out, cancelled=cancelled),
        text=outcome.text,
        tokens_generated=outcome.completion_tokens,
        experts_used=[e.name for e in outcome.experts],
        latency_ms=latency_ms,
        finish_reason=reason,
        timed_out=timed_out,
        reasoning_trace=trace,
        error=outcome.error if error is None else error,
        experts=outcome.experts,
        dropped_experts=dropped_experts,
        choices=choices,
    )


def set_failure(
    result: common_pb2.InferenceResult, code: grpc.StatusCode, fields: Sequence[tuple[str, str]] = ()
) -> None:
    """Record in `result` why its job failed: the stage's gRPC code (and its name, for the clients
    that read `error_code`) and the fields it found invalid."""
    result.error_status_code = code.value[0]
    result.error_code = code.name
    result.error_fields.extend(common_pb2.FieldError(field=f, description=d) for f, d in fields)


def failure_code(result: common_pb2.InferenceResult) -> grpc.StatusCode | None:
    """The gRPC code a stage failed the job with; None when the result records none."""
    return _STATUS_CODES.get(result.error_status_code)
