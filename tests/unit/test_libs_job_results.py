"""The status rules every job result follows, postproc's and reception's alike."""

from __future__ import annotations

import pytest

from libs.gen.expert.v1 import common_pb2
from libs.job_results import finish_reason, job_result, job_status, reasoning_trace

DONE = common_pb2.GenerationOutcome(
    text="Paris", completion_tokens=2, finish_reason=common_pb2.FINISH_REASON_STOP
)
BROKEN = common_pb2.GenerationOutcome(text="Par", completion_tokens=1, error="engine gone")


@pytest.mark.parametrize(
    ("outcome", "timed_out", "cancelled", "status", "finish"),
    [
        (DONE, False, False, common_pb2.JOB_STATUS_COMPLETED, common_pb2.FINISH_REASON_STOP),
        (BROKEN, False, False, common_pb2.JOB_STATUS_FAILED, common_pb2.FINISH_REASON_ERROR),
        (BROKEN, True, False, common_pb2.JOB_STATUS_TIMED_OUT, common_pb2.FINISH_REASON_TIMEOUT),
        (DONE, False, True, common_pb2.JOB_STATUS_CANCELLED, common_pb2.FINISH_REASON_ABORT),
        (BROKEN, True, True, common_pb2.JOB_STATUS_CANCELLED, common_pb2.FINISH_REASON_TIMEOUT),
    ],
)
def test_a_stop_comes_before_an_error(outcome, timed_out, cancelled, status, finish):
    assert job_status(outcome, timed_out=timed_out, cancelled=cancelled) == status
    assert finish_reason(outcome, timed_out=timed_out, cancelled=cancelled) == finish


def test_the_result_carries_the_outcome_the_traces_and_the_error():
    outcome = common_pb2.GenerationOutcome(
        text="Paris", completion_tokens=2, experts=[common_pb2.AppliedExpert(name="geo", version="1.0.0")]
    )
    plan = common_pb2.ExpertPlan(reasoning_trace="router: chose geo")
    placement = common_pb2.Placement(trace=["preparation: engine e1"], dropped_experts=["big"])
    result = job_result(
        "j-1",
        outcome,
        timed_out=False,
        cancelled=False,
        latency_ms=12.5,
        trace=reasoning_trace(plan, placement),
        dropped_experts=placement.dropped_experts,
        error="postproc: down",
    )
    assert (result.job_id, result.text, result.tokens_generated, list(result.experts_used)) == (
        "j-1",
        "Paris",
        2,
        ["geo"],
    )
    assert result.reasoning_trace == "router: chose geo\npreparation: engine e1"
    assert (list(result.dropped_experts), result.error, result.latency_ms) == (
        ["big"],
        "postproc: down",
        12.5,
    )
    assert not result.HasField("validation") and not result.HasField("metrics")


def test_each_choice_keeps_its_own_end_unless_the_job_was_stopped_or_failed():
    outcome = common_pb2.GenerationOutcome(
        text="Paris",
        completion_tokens=5,
        finish_reason=common_pb2.FINISH_REASON_STOP,
        choices=[
            common_pb2.Choice(
                index=0, text="Paris", finish_reason=common_pb2.FINISH_REASON_STOP, tokens_generated=2
            ),
            common_pb2.Choice(
                index=1, text="Lyon?", finish_reason=common_pb2.FINISH_REASON_LENGTH, tokens_generated=3
            ),
        ],
    )

    def ends(**stopped) -> list[int]:
        result = job_result("j", outcome, latency_ms=1.0, trace="", **stopped)
        assert [c.text for c in result.choices] == ["Paris", "Lyon?"] and result.tokens_generated == 5
        return [c.finish_reason for c in result.choices]

    assert ends(timed_out=False, cancelled=False) == [
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_LENGTH,
    ]
    assert ends(timed_out=True, cancelled=False) == [common_pb2.FINISH_REASON_TIMEOUT] * 2
    assert ends(timed_out=False, cancelled=True) == [common_pb2.FINISH_REASON_ABORT] * 2
