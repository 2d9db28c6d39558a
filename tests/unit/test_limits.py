"""Each limit of a request is written once, in libs/limits.py, and every place that checks it uses
that one rule: reception's validation and the engine's SamplingParams refuse the same sampling
values (the engine takes more only where libs.limits says why), reception, the router and the
engine's expert manager stop at the same MAX_EXPERTS, and a session, the router's overrides and an
OpenAI body carry the same SAMPLING_FIELDS."""

from __future__ import annotations

import pytest
import torch

from libs.engine import InvalidRequestError, SamplingParams
from libs.engine.adapters.manager import ExpertManager
from libs.engine.adapters.registry import ExpertNotFoundError
from libs.engine.config import AdapterConfig
from libs.engine.models.config import ModelConfig
from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2, session_pb2, session_state_pb2
from libs.limits import (
    API_BOUNDS,
    ENGINE_BOUNDS,
    ENGINE_MAX_CHOICES,
    MAX_CHOICES,
    MAX_EXPERTS,
    MAX_LOGPROBS,
    SAMPLING_FIELDS,
    sampling_problems,
)
from services.reception.admission.validation import validate
from services.reception.http.openai_request import to_request
from services.reception.http.openai_schema import CompletionRequest
from services.reception.sessions import turn_request
from services.router.features import Features
from services.router.matching import PromptQuery
from services.router.selection import select_experts
from services.router.tuning import tune_parameters

# A value for each sampling field, inside every bound and unlike any default.
SAMPLING = {
    "temperature": 0.25,
    "top_p": 0.5,
    "top_k": 7,
    "min_p": 0.125,
    "repetition_penalty": 1.25,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 9,
}


def reception_refusal(**fields) -> dict[str, str]:
    """Field -> description of each of reception's refusals of a request with `fields`."""
    try:
        validate(common_pb2.InferenceRequest(prompt="Hello", **fields))
    except ServiceError as error:
        return dict(error.violations)
    return {}


def engine_refusal(**fields) -> tuple[str, str] | None:
    """The engine's refusal of SamplingParams with `fields`, as (field, description)."""
    try:
        SamplingParams(**fields)
    except InvalidRequestError as error:
        return error.field, error.description
    return None


REFUSED_BY_BOTH = [
    ("temperature", -0.5),
    ("temperature", 2.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("min_p", -0.5),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", 2.5),
    ("n", 0),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_BY_BOTH, ids=[f"{f}={v}" for f, v in REFUSED_BY_BOTH])
def test_the_engine_and_reception_refuse_the_same_sampling_value(field, value):
    assert list(reception_refusal(**{field: value})) == [f"request.{field}"]
    refusal = engine_refusal(**{field: value})
    assert refusal is not None and refusal[0] == field


ACCEPTED_BY_BOTH = [
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("top_p", 1.0),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("repetition_penalty", 1.0),
    ("repetition_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("n", 1),
    ("n", MAX_CHOICES),
    ("logprobs", 0),
    ("logprobs", MAX_LOGPROBS),
]


@pytest.mark.parametrize(("field", "value"), ACCEPTED_BY_BOTH, ids=[f"{f}={v}" for f, v in ACCEPTED_BY_BOTH])
def test_the_engine_and_reception_accept_the_same_edge_value(field, value):
    assert reception_refusal(**{field: value}) == {}
    assert engine_refusal(**{field: value}) is None


def test_the_engine_and_reception_refuse_the_same_repetition_penalty_above_2_and_only_reception_one_below_1():
    """The API takes [1, 2]; the engine (0, 2], vLLM's bound, which a checkpoint's recommended
    value may use (the exception written in libs.limits)."""
    assert reception_refusal(repetition_penalty=2.5) == {
        "request.repetition_penalty": "must be in [1, 2], got 2.5"
    }
    assert engine_refusal(repetition_penalty=2.5) == ("repetition_penalty", "must be in (0, 2], got 2.5")
    assert reception_refusal(repetition_penalty=0.5) == {
        "request.repetition_penalty": "must be in [1, 2], got 0.5"
    }
    assert engine_refusal(repetition_penalty=0.5) is None


def test_n_above_MAX_CHOICES_is_refused_by_reception_and_above_ENGINE_MAX_CHOICES_by_the_engine():
    """A served request shares the batch (MAX_CHOICES); an in-process caller owns it."""
    assert reception_refusal(n=MAX_CHOICES + 1) == {
        "request.n": f"must be in [1, {MAX_CHOICES}], got {MAX_CHOICES + 1}"
    }
    assert engine_refusal(n=MAX_CHOICES + 1) is None
    assert engine_refusal(n=ENGINE_MAX_CHOICES) is None
    assert engine_refusal(n=ENGINE_MAX_CHOICES + 1) == (
        "n",
        f"must be in [1, {ENGINE_MAX_CHOICES}], got {ENGINE_MAX_CHOICES + 1}",
    )


def test_logprobs_above_MAX_LOGPROBS_is_refused_by_reception_and_by_the_engine_with_the_same_words():
    expected = f"must be in [0, {MAX_LOGPROBS}], got {MAX_LOGPROBS + 1}"
    assert reception_refusal(logprobs=MAX_LOGPROBS + 1) == {"request.logprobs": expected}
    assert engine_refusal(logprobs=MAX_LOGPROBS + 1) == ("logprobs", expected)


def test_the_engine_takes_more_than_the_api_only_in_the_fields_libs_limits_explains():
    wider = {name for name in API_BOUNDS if ENGINE_BOUNDS[name] != API_BOUNDS[name]}
    assert wider == {"n", "repetition_penalty", "top_k", "max_tokens"}
    for name in wider:  # wider, never narrower: whatever reception lets through, the engine takes
        api, engine = API_BOUNDS[name], ENGINE_BOUNDS[name]
        assert engine.low <= api.low and (engine.high is None or engine.high >= api.high)


def test_sampling_problems_lists_every_value_out_of_bounds_in_the_order_of_the_bounds():
    found = sampling_problems({"n": 0, "top_p": 0.5, "temperature": float("nan"), "top_k": -1})
    assert found == [
        ("temperature", "must be in [0, 2], got nan"),
        ("top_k", "must be >= 0 (0 = off), got -1"),
        ("n", f"must be in [1, {MAX_CHOICES}], got 0"),
    ]
    assert sampling_problems({"top_k": -1}, ENGINE_BOUNDS) == []


@pytest.mark.parametrize(("field", "value"), [("n", 1.0), ("top_k", True), ("temperature", "hot")])
def test_a_value_of_the_wrong_kind_is_refused_naming_its_field(field, value):
    ((named, description),) = sampling_problems({field: value})
    assert named == field and description.startswith("expected ")


def test_reception_refuses_one_expert_more_than_MAX_EXPERTS():
    names = [f"expert-{i}" for i in range(MAX_EXPERTS + 1)]
    assert reception_refusal(max_experts=MAX_EXPERTS, force_experts=names[:-1]) == {}
    assert reception_refusal(max_experts=MAX_EXPERTS + 1, force_experts=names) == {
        "request.max_experts": f"max_experts must be in [1, {MAX_EXPERTS}]",
        "request.force_experts": f"at most {MAX_EXPERTS} experts, got {MAX_EXPERTS + 1}",
    }


class NoExperts:
    """An expert index that knows no expert."""

    def find(self, name):
        return None


def forced_count_refusal(force: list[str], max_experts: int) -> list[tuple[str, str]]:
    features = Features(language="en", has_json=False, has_code=False, task_type="general")
    query = PromptQuery(text="Hello", vectors=torch.zeros(1, 4))
    with pytest.raises(ServiceError) as refused:
        select_experts(features, query, NoExperts(), max_experts=max_experts, force=force)
    return [v for v in refused.value.violations if v[0] == "request.force_experts"]


def test_the_router_forces_at_most_MAX_EXPERTS_whatever_max_experts_asks():
    names = [f"expert-{i}" for i in range(MAX_EXPERTS + 1)]
    assert forced_count_refusal(names[:-1], max_experts=MAX_EXPERTS + 5) == []
    assert forced_count_refusal(names, max_experts=MAX_EXPERTS + 5) == [
        ("request.force_experts", f"{MAX_EXPERTS + 1} experts forced, more than max_experts {MAX_EXPERTS}")
    ]


def test_the_engine_refuses_one_expert_more_than_MAX_EXPERTS_before_looking_any_up(tiny_llama):
    manager = ExpertManager(ModelConfig.from_dir(tiny_llama), AdapterConfig(), torch.device("cpu"))
    names = [f"expert-{i}" for i in range(MAX_EXPERTS + 1)]
    with pytest.raises(ExpertNotFoundError):  # MAX_EXPERTS pass the count: the first is unknown
        manager.resolve(names[:-1])
    with pytest.raises(InvalidRequestError) as refused:
        manager.resolve(names)
    assert (refused.value.field, refused.value.description) == (
        "experts",
        f"at most {MAX_EXPERTS} experts per request, got {MAX_EXPERTS + 1}",
    )


def test_every_message_that_carries_sampling_has_every_sampling_field():
    for message in (
        common_pb2.InferenceRequest,
        common_pb2.GenerationParams,
        session_pb2.SessionSampling,
    ):
        assert set(SAMPLING_FIELDS) <= set(message.DESCRIPTOR.fields_by_name), message.DESCRIPTOR.name
    assert set(SAMPLING) == set(SAMPLING_FIELDS)


def test_the_users_sampling_overrides_the_routers_tuning_field_for_field():
    request = common_pb2.InferenceRequest(prompt="Hello", **SAMPLING)
    features = Features(language="en", has_json=False, has_code=False, task_type="general")
    params, _ = tune_parameters(features, request)
    assert {name: getattr(params, name) for name in SAMPLING_FIELDS} == {
        name: getattr(request, name) for name in SAMPLING_FIELDS
    }


def test_an_openai_body_carries_every_sampling_field_into_the_request():
    request = to_request(CompletionRequest(model="tiny", prompt="Hello", **SAMPLING))
    assert all(request.HasField(name) for name in SAMPLING_FIELDS)
    expected = common_pb2.InferenceRequest(**SAMPLING)
    assert {n: getattr(request, n) for n in SAMPLING_FIELDS} == {
        n: getattr(expected, n) for n in SAMPLING_FIELDS
    }


def test_a_sessions_sampling_carries_every_sampling_field_into_its_turns():
    settings = session_pb2.CreateSessionRequest(sampling=session_pb2.SessionSampling(**SAMPLING))
    record = session_state_pb2.SessionRecord(settings=settings)
    request = turn_request(record, session_pb2.GenerateStreamRequest())
    expected = common_pb2.InferenceRequest(**SAMPLING)
    assert {n: getattr(request, n) for n in SAMPLING_FIELDS} == {
        n: getattr(expected, n) for n in SAMPLING_FIELDS
    }
