"""SamplingParams validates every field on construction; errors name the field."""

from __future__ import annotations

import pytest

from libs.engine import InvalidRequestError, OutputKind, SamplingParams

INVALID = [
    ("n", 0),
    ("n", 65),
    ("n", 1.0),
    ("n", True),
    ("n", None),
    ("temperature", -0.1),
    ("temperature", 2.1),
    ("temperature", "hot"),
    ("temperature", True),
    ("temperature", float("nan")),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.1),
    ("top_p", -0.5),
    ("top_p", False),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", True),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 2.1),
    ("repetition_penalty", True),
    ("presence_penalty", -2.1),
    ("presence_penalty", 2.1),
    ("presence_penalty", False),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", True),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "7"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("output_kind", "delta"),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_an_invalid_value_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"stop": ["ok", 5]}, "stop[1]"),
        ({"stop": ""}, "stop[0]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [3, 1.0]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [3, True]}, "stop_token_ids[1]"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids[0]"),
    ],
    ids=repr,
)
def test_an_invalid_list_element_is_named_by_its_index(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(("field", "value"), [("stop", 5), ("stop_token_ids", 5)])
def test_a_stop_value_that_is_not_a_list_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output"])
def test_a_boolean_field_given_a_string_is_refused_naming_it(field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: "false"})
    assert info.value.field == field


VALID_EDGES = [
    ("n", 1),
    ("n", 64),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("top_p", 1.0),
    ("top_p", 1e-6),
    ("top_k", 0),
    ("top_k", 1),
    ("top_k", 100_000),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("repetition_penalty", 1e-3),
    ("repetition_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("seed", 0),
    ("seed", 2**64 - 1),
    ("seed", None),
    ("max_tokens", 1),
    ("max_tokens", None),
    ("logprobs", 0),
    ("logprobs", 20),
    ("logprobs", None),
    ("stop_token_ids", [0]),
]


@pytest.mark.parametrize(("field", "value"), VALID_EDGES, ids=[f"{f}={v!r}" for f, v in VALID_EDGES])
def test_a_valid_edge_value_is_accepted_unchanged(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


@pytest.mark.parametrize("kind", list(OutputKind))
def test_every_output_kind_is_accepted(kind):
    assert SamplingParams(output_kind=kind).output_kind is kind


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="x").stop == ["x"]


def test_stop_none_becomes_an_empty_list():
    assert SamplingParams(stop=None).stop == []


def test_a_stop_tuple_becomes_a_list():
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_token_ids_none_becomes_an_empty_list():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_top_k_minus_one_normalizes_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_uses_penalties_only_when_one_is_set():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties


def test_the_error_is_a_value_error_with_a_description():
    with pytest.raises(ValueError, match=r"^temperature: must be in \[0, 2\]") as info:
        SamplingParams(temperature=3)
    assert isinstance(info.value, InvalidRequestError)
    assert "3" in info.value.description
