"""libs.response_format: the json_schema shorthand and response_format become one ResponseFormat,
and each kind of format the StructuredOutput of the same kind and text."""

from __future__ import annotations

import pytest

from libs.gen.expert.v1 import common_pb2
from libs.response_format import from_request, to_structured
from libs.structured_output import StructuredOutput

SCHEMA = '{"type": "object", "required": ["a"]}'


def test_a_request_without_a_format_has_none():
    assert from_request(common_pb2.InferenceRequest(prompt="x")) is None
    assert to_structured(None) is None
    assert to_structured(common_pb2.GenerationParams().response_format) is None  # unset reads as empty


def test_the_json_schema_shorthand_is_a_json_schema_format():
    found = from_request(common_pb2.InferenceRequest(prompt="x", json_schema=SCHEMA))
    assert found == common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema=SCHEMA))
    assert to_structured(found) == StructuredOutput("json_schema", SCHEMA)


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        (common_pb2.ResponseFormat(json_object={}), StructuredOutput("json_object")),
        (
            common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(name="n", schema=SCHEMA)),
            StructuredOutput("json_schema", SCHEMA),
        ),
        (common_pb2.ResponseFormat(regex="[0-9]+"), StructuredOutput("regex", "[0-9]+")),
        (common_pb2.ResponseFormat(grammar='start: "a"'), StructuredOutput("grammar", 'start: "a"')),
        (common_pb2.ResponseFormat(regex=""), StructuredOutput("regex", "")),  # set, and empty
    ],
)
def test_each_kind_becomes_the_structured_output_of_that_kind(response_format, expected):
    request = common_pb2.InferenceRequest(prompt="x", response_format=response_format)
    found = from_request(request)
    assert found == response_format
    assert found is not request.response_format  # a copy: the plan does not share the request's
    assert to_structured(found) == expected


def test_an_empty_response_format_is_no_format():
    assert from_request(common_pb2.InferenceRequest(prompt="x", response_format={})) is None
