"""Postproc validates each of a job's choices: each choice carries its own validation, the result's
validation is the first choice's, and the job passes only when every choice does."""

from __future__ import annotations

import asyncio

from libs.gen.expert.v1 import common_pb2, postproc_pb2
from services.postproc.finalizer import Finalizer
from services.postproc.metrics import PostprocMetrics
from tests.helpers.in_process import shared_metrics


def test_each_choice_is_validated_against_the_schema():
    published = []

    async def publish(stream: str, fields: dict[str, bytes]) -> None:
        published.append(fields)

    outcome = common_pb2.GenerationOutcome(
        text='{"a": 1}',
        completion_tokens=5,
        finish_reason=common_pb2.FINISH_REASON_STOP,
        choices=[
            common_pb2.Choice(index=0, text='{"a": 1}', finish_reason=common_pb2.FINISH_REASON_STOP),
            common_pb2.Choice(index=1, text="[1]", finish_reason=common_pb2.FINISH_REASON_LENGTH),
        ],
    )
    request = postproc_pb2.FinalizeRequest(job_id="j", outcome=outcome, json_schema='{"type": "object"}')
    result = asyncio.run(Finalizer(publish, shared_metrics(PostprocMetrics)).finalize(request))
    assert [(c.index, c.validation.valid) for c in result.choices] == [(0, True), (1, False)]
    assert result.choices[1].validation.error == "(root): [1] is not of type 'object'"
    assert result.validation.valid and not result.metrics.validation_passed
    assert [c.finish_reason for c in result.choices] == [
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_LENGTH,
    ]
    assert result.text == '{"a": 1}' and len(published) == 1
