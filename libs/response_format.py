"""A request's output format (docs/api.md#structured-output) as the pipeline carries it: the one
place that turns the `json_schema` shorthand into a `ResponseFormat`, and a `ResponseFormat` into
the `StructuredOutput` that libs.structured_output checks and the engine enforces.

Reception validates with it, the router copies its format into the plan's generation parameters,
the engine service builds its SamplingParams from it and postproc picks its validator with it, so
the shorthand means the same thing at every stage.
"""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2
from libs.structured_output import StructuredOutput


def from_request(request: common_pb2.InferenceRequest) -> common_pb2.ResponseFormat | None:
    """The format the request asks for: its `response_format`, else its `json_schema` shorthand as a
    json_schema format; None for free text (and for a `response_format` with no format set, which
    reception refuses)."""
    if request.HasField("response_format") and request.response_format.WhichOneof("format"):
        normalized = common_pb2.ResponseFormat()
        normalized.CopyFrom(request.response_format)
        return normalized
    if request.HasField("json_schema"):
        return common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema=request.json_schema))
    return None


def to_structured(response_format: common_pb2.ResponseFormat | None) -> StructuredOutput | None:
    """The StructuredOutput of a format; None when there is none (an unset message field reads as
    an empty ResponseFormat, so `to_structured(params.response_format)` needs no presence test)."""
    kind = response_format.WhichOneof("format") if response_format is not None else None
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        return StructuredOutput("json_schema", response_format.json_schema.schema)
    return StructuredOutput(kind, getattr(response_format, kind))
