"""Reception's validation rules (docs/design.md#validation-rules), one test per rule, without a
server: each bad request is refused with INVALID_ARGUMENT naming its field, and normalization
rewrites the request in place."""

from __future__ import annotations

import grpc
import pytest

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from services.reception.validation import MAX_PROMPT_CHARS, MAX_STOP_STRINGS, validate


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
