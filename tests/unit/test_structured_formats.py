"""The structured output formats: their checks, the byte-level text check, the closing of declared
objects, and the sampler's token mask."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from libs.engine.sampler import Sampler, SamplingBatch
from libs.structured_output import (
    MAX_FORMAT_BYTES,
    StructuredOutput,
    format_problem,
    only_declared,
    text_problem,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
    "required": ["name"],
}


def test_every_kind_compiles_and_checks_a_text():
    cases = [
        (StructuredOutput("json_object"), '{"a": [1, 2]}', "[1, 2]"),
        (
            StructuredOutput("json_schema", json.dumps(PERSON)),
            '{"name": "Ana", "age": 41}',
            '{"name": "Ana", "age": 200}',
        ),
        (StructuredOutput("regex", r"\d{3}-\d{4}"), "555-1234", "555-12345"),
        (StructuredOutput("grammar", 'start: "a" NUM\nNUM: /[0-9]+/\n'), "a42", "b42"),
    ]
    for structured, good, bad in cases:
        assert format_problem(structured) is None
        assert text_problem(structured, good) is None
        assert text_problem(structured, bad) is not None


def test_a_text_that_stops_early_or_runs_on_is_told_apart():
    structured = StructuredOutput("regex", r"\d{3}-\d{4}")
    assert text_problem(structured, "555-12") == "ends before the format is complete"
    assert text_problem(structured, "555-12345").startswith("does not match from byte 8")
    assert text_problem(StructuredOutput("regex", ".{0,5}"), "日本") is None  # bytes, not characters


@pytest.mark.parametrize(
    ("structured", "problem"),
    [
        (StructuredOutput("regex", "[a-z"), "unclosed character class"),
        (StructuredOutput("regex", "(?=a)b"), "look-around"),
        (StructuredOutput("regex", ""), "must not be empty"),
        (StructuredOutput("grammar", "start: nothing_here\n"), 'unknown name: "nothing_here"'),
        (StructuredOutput("grammar", "start: start\n"), "no output can be generated under it"),
        (StructuredOutput("json_schema", '{"not": {"type": "string"}}'), 'Unimplemented keys: ["not"]'),
        (StructuredOutput("json_schema", "[1]"), "not a JSON schema object"),
        (StructuredOutput("json_schema", "{"), "not a JSON schema object"),
        (StructuredOutput("json_schema", "[" * 3000 + "]" * 3000), "nested too deeply"),
        (StructuredOutput("regex", "a" * (MAX_FORMAT_BYTES + 1)), f"at most {MAX_FORMAT_BYTES} bytes"),
    ],
)
def test_what_the_library_cannot_enforce_is_refused_with_its_reason(structured, problem):
    assert problem in format_problem(structured)


def test_equal_formats_share_a_key_and_unknown_kinds_are_refused():
    assert StructuredOutput("regex", "a").key == StructuredOutput("regex", "a").key
    assert StructuredOutput("regex", "a").key != StructuredOutput("grammar", "a").key
    with pytest.raises(ValueError, match="unknown structured output kind"):
        StructuredOutput("xml", "")


def test_declared_objects_are_closed_except_where_the_schema_says_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {}}},
            "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
            "choice": {"enum": [{"properties": {"kept": 1}}]},
            "properties": {"type": "object", "properties": {"y": {}}},
        },
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "$defs": {"d": {"properties": {"z": {}}}},
    }
    closed = only_declared(json.loads(json.dumps(schema)))
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["choice"] == schema["properties"]["choice"]  # values are not schemas
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property named "properties" stays one
    assert all("additionalProperties" not in part for part in closed["allOf"])
    assert closed["$defs"]["d"]["additionalProperties"] is False
    # What is generated under the closed schema still satisfies the original.
    jsonschema.validate({"inner": {"x": 1}}, schema)


def test_a_deep_schema_is_closed_without_recursion():
    schema: dict = {"type": "object", "properties": {}}
    node = schema
    for _ in range(5000):
        child: dict = {"type": "object", "properties": {}}
        node["properties"]["c"] = child
        node = child
    depth = 0
    node = only_declared(schema)
    while node["properties"]:
        assert node["additionalProperties"] is False
        node, depth = node["properties"]["c"], depth + 1
    assert depth == 5000


def _batch(rows: int, **settings) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), settings.get("temperature", 0.0)),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seed_lo=torch.arange(rows, dtype=torch.int64),
        seed_hi=torch.zeros(rows, dtype=torch.int64),
        step=torch.zeros(rows, dtype=torch.int64),
        all_greedy=settings.get("temperature", 0.0) == 0.0,
    )


def _bitmask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    bits = torch.zeros((len(allowed), (vocab + 31) // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            bits[row, token // 32] |= 1 << (token % 32)
    return bits.to(torch.int32)  # wraps bit 31 into the sign, as llguidance writes it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_picks_only_allowed_tokens_and_leaves_other_rows_alone(temperature):
    vocab = 100
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [{31, 63, 64}, {99}]
    for step in range(3):
        free_batch, batch = _batch(4, temperature=temperature), _batch(4, temperature=temperature)
        free_batch.step += step
        batch.step += step
        batch.constrained_rows = torch.tensor([1, 3])
        batch.allowed_tokens = _bitmask(allowed, vocab)
        free, out = Sampler()(logits, free_batch), Sampler()(logits, batch)
        assert out.token_ids[1].item() in allowed[0] and out.token_ids[3].item() == 99
        assert out.token_ids[0] == free.token_ids[0] and out.token_ids[2] == free.token_ids[2]
