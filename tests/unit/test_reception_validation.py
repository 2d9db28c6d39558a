"""Reception's validation rules (docs/design.md#validation-rules), one test per rule, without a
server: each bad request is refused with INVALID_ARGUMENT naming its field, and normalization
rewrites the request in place."""

from __future__ import annotations

import grpc
import pytest

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from libs.structured_output import MAX_FORMAT_BYTES
from services.reception.admission.validation import (
    MAX_BODY_CHARS,
    MAX_EXCLUDED_EXPERTS,
    MAX_INPUT_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPLATE_CHARS,
    json_depth,
    validate,
)


def request(**fields) -> common_pb2.InferenceRequest:
    fields.setdefault("prompt", "Hello")
    return common_pb2.InferenceRequest(**fields)


def problems(req: common_pb2.InferenceRequest, max_model_len: int = 0) -> dict[str, str]:
    """Field -> message of every violation (empty when the request is valid)."""
    try:
        validate(req, max_model_len)
    except ServiceError as error:
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        return dict(error.violations)
    return {}


def test_a_plain_request_is_valid():
    assert problems(request()) == {}


def test_an_empty_prompt_is_refused():
    assert problems(request(prompt="   ")) == {"request.prompt": "Prompt cannot be empty"}


def test_chat_messages_may_stand_in_for_the_prompt():
    message = common_pb2.ChatMessage(role="user", content="Hi")
    assert problems(request(prompt="", messages=[message])) == {}


def test_a_prompt_over_500000_characters_is_refused():
    assert problems(request(prompt="a" * MAX_PROMPT_CHARS)) == {}
    assert "Prompt too long" in problems(request(prompt="a" * (MAX_PROMPT_CHARS + 1)))["request.prompt"]


@pytest.mark.parametrize("value", [-0.1, 2.01, float("nan"), float("inf")])
def test_temperature_outside_0_to_2_is_refused(value):
    assert problems(request(temperature=value)) == {
        "request.temperature": "Temperature must be in [0.0, 2.0]"
    }


@pytest.mark.parametrize("value", [0, 200_001])
def test_max_tokens_outside_1_to_200000_is_refused(value):
    assert problems(request(max_tokens=value)) == {"request.max_tokens": "max_tokens must be in [1, 200000]"}


@pytest.mark.parametrize("value", [0, 11])
def test_max_experts_outside_1_to_10_is_refused(value):
    assert problems(request(max_experts=value)) == {"request.max_experts": "max_experts must be in [1, 10]"}


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("top_p", 0.0, 1.0),
        ("min_p", 1.5, 0.0),
        ("repetition_penalty", 0.9, 2.0),
        ("presence_penalty", -2.5, -2.0),
        ("frequency_penalty", 2.5, 2.0),
    ],
)
def test_sampling_bounds_name_their_field(field, bad, good):
    assert list(problems(request(**{field: bad}))) == [f"request.{field}"]
    assert problems(request(**{field: good})) == {}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"top_k": -1}, "request.top_k"),
        ({"priority": 10}, "request.priority"),
        ({"timeout_ms": 0}, "request.timeout_ms"),
        ({"context_size": 0}, "request.context_size"),
    ],
)
def test_integer_bounds_name_their_field(fields, field):
    assert list(problems(request(**fields))) == [field]


def test_at_most_16_stop_strings_none_empty():
    assert problems(request(stop=["x"] * MAX_STOP_STRINGS)) == {}
    assert list(problems(request(stop=["x"] * (MAX_STOP_STRINGS + 1)))) == ["request.stop"]
    assert list(problems(request(stop=["x", ""]))) == ["request.stop[1]"]


def test_each_stop_string_is_bounded():
    assert problems(request(stop=["x" * MAX_STOP_CHARS])) == {}
    assert list(problems(request(stop=["ok", "x" * (MAX_STOP_CHARS + 1)]))) == ["request.stop[1]"]
    # the hostile request that once OOM-killed the engine: 16 stop strings of a million characters
    found = problems(request(stop=["x" * 1_000_000] * MAX_STOP_STRINGS))
    assert list(found) == [f"request.stop[{i}]" for i in range(MAX_STOP_STRINGS)]


def test_template_and_body_are_bounded_on_their_own():
    assert list(problems(request(template="{prompt}" + "x" * MAX_TEMPLATE_CHARS))) == ["request.template"]
    assert list(problems(request(body="x" * (MAX_BODY_CHARS + 1)))) == ["request.body"]


def test_the_rendered_input_is_bounded_whatever_makes_it_long():
    # a 108 KB request whose template repeats a 100,000-character prompt a thousand times
    found = problems(request(prompt="p" * 100_000, template="{prompt}" * 1000))
    assert list(found) == ["request.template"]
    assert "100000000 characters" in found["request.template"]
    # the default body template adds the body to the prompt
    half = MAX_INPUT_CHARS // 2
    assert list(problems(request(prompt="p" * half, body="b" * half))) == ["request.body"]
    assert problems(request(prompt="p" * (half - 2), body="b" * half)) == {}
    # messages count toward the same input
    long_turn = common_pb2.ChatMessage(role="user", content="m" * half)
    assert list(problems(request(prompt="p" * (half + 1), messages=[long_turn]))) == ["request.messages"]
    assert problems(request(prompt="p" * half, messages=[long_turn])) == {}
    # a prompt holding "{body}" is not a second placeholder
    assert problems(request(prompt="{body}" * 1000, template="{prompt}", body="b" * 10_000)) == {}


def test_the_number_of_messages_is_bounded():
    turn = common_pb2.ChatMessage(role="user", content="hi")
    assert problems(request(messages=[turn] * MAX_MESSAGES)) == {}
    assert list(problems(request(messages=[turn] * (MAX_MESSAGES + 1)))) == ["request.messages"]


def test_names_and_user_ids_are_bounded():
    assert list(problems(request(user_id="u" * (MAX_NAME_CHARS + 1)))) == ["request.user_id"]
    assert list(problems(request(force_experts=["e" * (MAX_NAME_CHARS + 1)]))) == ["request.force_experts[0]"]
    excluded = [f"e{i}" for i in range(MAX_EXCLUDED_EXPERTS + 1)]
    assert list(problems(request(exclude_experts=excluded))) == ["request.exclude_experts"]


def test_a_message_role_must_be_known():
    message = common_pb2.ChatMessage(role="robot", content="Hi")
    assert list(problems(request(messages=[message]))) == ["request.messages[0].role"]


def test_a_raw_completion_carries_no_messages():
    message = common_pb2.ChatMessage(role="user", content="Hi")
    assert list(problems(request(raw=True, messages=[message]))) == ["request.raw"]


def test_expert_lists_are_bounded_non_empty_and_disjoint():
    assert list(problems(request(force_experts=[f"e{i}" for i in range(11)]))) == ["request.force_experts"]
    assert list(problems(request(exclude_experts=[" "]))) == ["request.exclude_experts[0]"]
    assert list(problems(request(force_experts=["a"], exclude_experts=["a"]))) == ["request.exclude_experts"]


def test_the_context_window_bounds_context_size_and_max_tokens():
    assert list(problems(request(context_size=4096), max_model_len=2048)) == ["request.context_size"]
    assert list(problems(request(max_tokens=2048), max_model_len=2048)) == ["request.max_tokens"]
    assert list(problems(request(context_size=512, max_tokens=600), max_model_len=2048)) == [
        "request.max_tokens"
    ]
    assert problems(request(max_tokens=2048)) == {}  # no engine known yet: the engine checks


def test_a_json_schema_must_be_a_valid_schema():
    assert problems(request(json_schema='{"type": "object"}')) == {}
    assert list(problems(request(json_schema="{not json"))) == ["request.json_schema"]
    assert list(problems(request(json_schema='{"type": 12}'))) == ["request.json_schema"]


def test_a_schema_is_bounded_in_size_and_depth_without_recursing():
    assert list(problems(request(json_schema='{"type": "string"}' + " " * MAX_FORMAT_BYTES))) == [
        "request.json_schema"
    ]
    nested = '{"type": "object", "properties": {"a": ' * 8 + "{}" + "}}" * 8
    assert problems(request(json_schema=nested)) == {}
    too_deep = '{"items": ' * (MAX_SCHEMA_DEPTH + 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 1)
    assert "nested" in problems(request(json_schema=too_deep))["request.json_schema"]
    # deeper than Python's recursion limit, within the size cap: refused, not a RecursionError
    hostile = "[" * (MAX_FORMAT_BYTES // 2) + "]" * (MAX_FORMAT_BYTES // 2)
    assert list(problems(request(json_schema=hostile))) == ["request.json_schema"]


def test_json_depth_ignores_brackets_inside_strings():
    assert json_depth('{"a": "[[[{{\\"[", "b": [[1]]}') == 3
    assert json_depth("[]") == 1
    assert json_depth('"{"') == 0


def test_a_schema_reference_must_resolve_within_the_schema():
    local = '{"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}}'
    assert problems(request(json_schema=local)) == {}
    # resolvable, but a schema that is only itself gives the engine no document to begin
    assert (
        "no output can be generated" in problems(request(json_schema='{"$ref": "#"}'))["request.json_schema"]
    )
    for ref in ("#/$defs/missing", "https://example.com/schema.json"):
        found = problems(request(json_schema=f'{{"$ref": "{ref}"}}'))
        assert "does not resolve" in found["request.json_schema"]


def test_nul_bytes_are_refused_not_normalized_away():
    assert list(problems(request(prompt="a\x00b"))) == ["request.prompt"]
    message = common_pb2.ChatMessage(role="user", content="a\x00")
    assert list(problems(request(messages=[message]))) == ["request.messages[0]"]
    assert list(problems(request(stop=["\x00"]))) == ["request.stop[0]"]


def test_text_is_nfc_normalized_and_prompt_and_user_id_are_trimmed():
    req = request(prompt="  Cafe\u0301  ", user_id=" ana ", body="  keep  ", stop=["e\u0301"])
    validate(req)
    assert (req.prompt, req.user_id, req.body, list(req.stop)) == ("Café", "ana", "  keep  ", ["é"])


def test_every_problem_is_reported_at_once():
    found = problems(request(prompt="", temperature=3.0, max_experts=0, top_p=0.0))
    assert set(found) == {"request.prompt", "request.temperature", "request.max_experts", "request.top_p"}


def test_n_is_1_to_16_and_logprobs_0_to_20():
    assert problems(request(n=1, logprobs=0)) == problems(request(n=16, logprobs=20)) == {}
    assert problems(request(n=2, temperature=0.0)) == {}  # identical choices, as vLLM allows
    assert set(problems(request(n=0, logprobs=-1))) == {"request.n", "request.logprobs"}
    assert set(problems(request(n=17, logprobs=21))) == {"request.n", "request.logprobs"}


# Structured output (docs/api.md#structured-output): every kind of format is checked before the job is
# queued, each refusal naming the part at fault.

SCHEMA_FIELD = "request.response_format.json_schema.schema"
REGEX_FIELD = "request.response_format.regex"
GRAMMAR_FIELD = "request.response_format.grammar"
NAME_FIELD = "request.response_format.json_schema.name"


def formatted(**response_format) -> common_pb2.InferenceRequest:
    return request(response_format=common_pb2.ResponseFormat(**response_format))


def schema_format(schema: str, **fields) -> common_pb2.InferenceRequest:
    return formatted(json_schema=common_pb2.JsonSchemaFormat(schema=schema, **fields))


def test_each_kind_of_format_is_accepted_when_the_engine_can_enforce_it():
    assert problems(formatted(json_object=common_pb2.JsonObjectFormat())) == {}
    assert problems(schema_format('{"type": "object"}', name="person", strict=True)) == {}
    assert problems(schema_format('{"type": "object"}')) == {}  # the name is optional on gRPC
    assert problems(formatted(regex=r"[0-9]{3}-[0-9]{4}")) == {}
    assert problems(formatted(grammar='start: "yes" | "no"')) == {}


@pytest.mark.parametrize(
    ("req", "field", "says"),
    [
        (schema_format('{"type": 12}'), SCHEMA_FIELD, "not a valid JSON schema"),
        (schema_format("{not json"), SCHEMA_FIELD, "not a valid JSON schema"),
        (
            schema_format('{"not": {"type": "string"}}'),
            SCHEMA_FIELD,
            'Unimplemented keys: ["not"]',
        ),
        (
            request(json_schema='{"uniqueItems": true}'),
            "request.json_schema",
            'Unimplemented keys: ["uniqueItems"]',
        ),
        (formatted(regex="a(?=b)"), REGEX_FIELD, "look-around"),
        (formatted(regex=r"(a)\1"), REGEX_FIELD, "backreferences are not supported"),
        (formatted(regex="[a"), REGEX_FIELD, "unclosed character class"),
        (formatted(regex=""), REGEX_FIELD, "must not be empty"),
        (formatted(grammar="start: undefined_rule"), GRAMMAR_FIELD, "unknown name"),
        (formatted(grammar=""), GRAMMAR_FIELD, "must not be empty"),
        (request(response_format=common_pb2.ResponseFormat()), "request.response_format", "set one of"),
    ],
)
def test_a_format_the_engine_cannot_enforce_is_refused_naming_its_part(req, field, says):
    found = problems(req)
    assert list(found) == [field]
    assert says in found[field]


def test_the_reason_of_a_bad_regex_survives_the_clipping_of_long_descriptions():
    long_regex = "[a-z]+@example" * 12 + "(?=x)"
    description = problems(formatted(regex=long_regex))[REGEX_FIELD]
    assert description.startswith("look-around, including look-ahead and look-behind, is not supported (")


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("json_schema", SCHEMA_FIELD),
        ("regex", REGEX_FIELD),
        ("grammar", GRAMMAR_FIELD),
        ("shorthand", "request.json_schema"),
    ],
)
def test_a_format_over_16_kb_is_refused_naming_its_field(kind, field):
    text = {
        "json_schema": '{"type": "string"}' + " " * MAX_FORMAT_BYTES,
        "shorthand": '{"type": "string"}' + " " * MAX_FORMAT_BYTES,
        "regex": "a" * (MAX_FORMAT_BYTES + 1),
        "grammar": 'start: "' + "a" * MAX_FORMAT_BYTES + '"',
    }[kind]
    req = {
        "json_schema": lambda: schema_format(text),
        "shorthand": lambda: request(json_schema=text),
        "regex": lambda: formatted(regex=text),
        "grammar": lambda: formatted(grammar=text),
    }[kind]()
    found = problems(req)
    assert list(found) == [field] and f"at most {MAX_FORMAT_BYTES} bytes" in found[field]


def test_the_16_kb_cap_counts_bytes():
    assert problems(formatted(regex="é" * (MAX_FORMAT_BYTES // 2))) == {}
    assert "bytes" in problems(formatted(regex="é" * (MAX_FORMAT_BYTES // 2 + 1)))[REGEX_FIELD]


def test_json_schema_and_response_format_are_not_both_set():
    both = request(json_schema='{"type": "object"}', response_format={"regex": "a+"})
    assert problems(both) == {"request.json_schema": "set either json_schema or response_format"}


def test_a_schema_format_name_is_bounded_and_its_description_too():
    assert problems(schema_format("{}", name="a-Z_09" * 10)) == {}  # 60 characters
    found = problems(schema_format("{}", name="x" * 65, description="d" * 1001))
    assert set(found) == {
        NAME_FIELD,
        "request.response_format.json_schema.description",
    }
    assert "at most 64" in problems(schema_format("{}", name="has space"))[NAME_FIELD]


def test_a_format_is_nfc_normalized_and_refuses_nul_bytes():
    req = formatted(regex="caf\u0065\u0301")
    validate(req)
    assert req.response_format.regex == "café"
    assert list(problems(formatted(regex="a\x00"))) == [REGEX_FIELD]
    nul_name = problems(schema_format("{}", name="a\x00"))
    assert NAME_FIELD in nul_name


def test_a_prompt_of_token_ids_stands_alone_and_fits_the_context():
    assert problems(common_pb2.InferenceRequest(prompt_token_ids=[1, 2, 3], raw=True)) == {}
    both = problems(request(prompt="Hi", prompt_token_ids=[1], template="{prompt}"))
    assert set(both) == {"request.prompt", "request.template"}
    assert problems(common_pb2.InferenceRequest(prompt_token_ids=[1, -4])) == {
        "request.prompt_token_ids[1]": "must be >= 0, got -4"
    }
    too_long = problems(common_pb2.InferenceRequest(prompt_token_ids=[1] * 64), max_model_len=64)
    assert too_long == {"request.prompt_token_ids": "64 tokens leave no room in the 64-token context"}
