"""Postproc validates each of a job's choices: each choice carries its own validation, the result's
validation is the first choice's, and the job passes only when every choice does. The plan's
output format picks the validator; a choice that max_tokens cut does not pass it."""

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
    request = postproc_pb2.FinalizeRequest(
        job_id="j", outcome=outcome, response_format={"json_schema": {"schema": '{"type": "object"}'}}
    )
    result = asyncio.run(Finalizer(publish, shared_metrics(PostprocMetrics)).finalize(request))
    assert [(c.index, c.validation.valid) for c in result.choices] == [(0, True), (1, False)]
    assert result.choices[1].validation.error == (
        "cut by max_tokens (finish_reason length) before the format ended: "
        "(root): [1] is not of type 'object'"
    )
    assert result.validation.valid and not result.metrics.validation_passed
    assert [c.finish_reason for c in result.choices] == [
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_LENGTH,
    ]
    assert result.text == '{"a": 1}' and len(published) == 1


def _finalize(response_format: dict, *texts: str) -> common_pb2.InferenceResult:
    async def publish(stream: str, fields: dict[str, bytes]) -> None:
        pass

    choices = [
        common_pb2.Choice(index=i, text=t, finish_reason=common_pb2.FINISH_REASON_STOP)
        for i, t in enumerate(texts)
    ]
    outcome = common_pb2.GenerationOutcome(
        text=texts[0], finish_reason=common_pb2.FINISH_REASON_STOP, choices=choices
    )
    request = postproc_pb2.FinalizeRequest(
        job_id="j", outcome=outcome, task_type="structured_output", response_format=response_format
    )
    return asyncio.run(Finalizer(publish, shared_metrics(PostprocMetrics)).finalize(request))


def test_the_format_picks_the_validator_of_each_choice():
    regex = _finalize({"regex": "[0-9]+"}, "42", "4x2")
    assert [(c.validation.validator, c.validation.valid) for c in regex.choices] == [
        ("regex", True),
        ("regex", False),
    ]
    grammar = _finalize({"grammar": 'start: "yes" | "no"'}, "no")
    assert (grammar.validation.validator, grammar.validation.valid) == ("grammar", True)
    json_object = _finalize({"json_object": {}}, "[]")
    assert (json_object.validation.validator, json_object.validation.valid) == ("json_schema", False)


def test_without_a_format_the_task_type_picks_the_validator():
    plain = _finalize({}, "some text")
    assert (plain.validation.validator, plain.validation.valid) == ("generic", True)
