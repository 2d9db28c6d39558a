"""The engine service's translation of GenerationParams into the engine's SamplingParams: the plan's
output format becomes the format the engine enforces, and the engine library's refusal of a request
(an InvalidRequestError naming its field, as a grammar that does not compile is refused) becomes
INVALID_ARGUMENT with that field."""

from __future__ import annotations

import grpc
import pytest

from libs.engine.errors import InvalidRequestError
from libs.gen.expert.v1 import common_pb2
from libs.structured_output import StructuredOutput
from services.engine.__main__ import map_error
from services.engine.server import sampling_params


@pytest.mark.parametrize(
    ("response_format", "structured"),
    [
        ({"json_object": {}}, StructuredOutput("json_object")),
        (
            {"json_schema": {"name": "n", "schema": '{"type": "object"}'}},
            StructuredOutput("json_schema", '{"type": "object"}'),
        ),
        ({"regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
        ({"grammar": 'start: "yes" | "no"'}, StructuredOutput("grammar", 'start: "yes" | "no"')),
    ],
)
def test_the_plans_format_is_the_one_the_engine_enforces(response_format, structured):
    params = common_pb2.GenerationParams(temperature=0.2, max_tokens=8, response_format=response_format)
    assert sampling_params(params).structured == structured


def test_without_a_format_the_output_is_free():
    assert sampling_params(common_pb2.GenerationParams(max_tokens=8)).structured is None


def test_the_engines_refusal_of_a_format_is_invalid_argument_naming_its_field():
    error = map_error(InvalidRequestError("structured", 'at 1(8): unknown name: "foo"'))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations == (("structured", 'at 1(8): unknown name: "foo"'),)


def test_vllms_ignore_eos_and_skip_special_tokens_reach_the_engine_unset_as_vllms_defaults():
    plain = sampling_params(common_pb2.GenerationParams(max_tokens=8))
    assert (plain.ignore_eos, plain.skip_special_tokens) == (False, True)
    asked = sampling_params(
        common_pb2.GenerationParams(max_tokens=8, ignore_eos=True, skip_special_tokens=False)
    )
    assert (asked.ignore_eos, asked.skip_special_tokens) == (True, False)


def test_the_speculative_flag_reaches_the_engine_unset_true_or_false():
    assert sampling_params(common_pb2.GenerationParams(max_tokens=8)).speculative is None
    for flag in (True, False):
        assert (
            sampling_params(common_pb2.GenerationParams(max_tokens=8, speculative=flag)).speculative is flag
        )


def test_the_plans_beam_search_reaches_the_engine():
    params = common_pb2.GenerationParams(
        max_tokens=8, n=2, best_of=4, use_beam_search=True, length_penalty=0.5, early_stopping="never"
    )
    engine = sampling_params(params)
    assert (engine.n, engine.best_of, engine.use_beam_search) == (2, 4, True)
    assert (engine.length_penalty, engine.early_stopping) == (0.5, "never")
    plain = sampling_params(common_pb2.GenerationParams(max_tokens=8, temperature=1.0))
    assert (plain.best_of, plain.use_beam_search, plain.length_penalty, plain.early_stopping) == (
        None,
        False,
        1.0,
        False,
    )
    assert (
        sampling_params(
            common_pb2.GenerationParams(max_tokens=8, n=2, use_beam_search=True, early_stopping="true")
        ).early_stopping
        is True
    )
