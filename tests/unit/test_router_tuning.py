"""The router's parameter tuning: the task-type table, the model's generation_config.json over it, the
deployment's ceiling on the default max_tokens, the context window, then the user's values; each
decision is a trace line. A request with an output format is a structured task, and its plan
carries the format to the engine."""

from __future__ import annotations

import asyncio

import pytest

from libs.config import ConfigError
from libs.gen.expert.v1 import common_pb2
from services.router.config import RouterConfig
from services.router.features import TASK_TYPES, Features, for_format
from services.router.planner import Planner
from services.router.tuning import DEFAULT_MAX_TOKENS_CEILING, tune_parameters


def features(task_type: str = "general") -> Features:
    return Features(language="en", has_json=False, has_code=False, task_type=task_type)


def test_without_max_tokens_the_table_budget_is_capped_by_the_ceiling_and_the_trace_says_both():
    params, trace = tune_parameters(features("creative_writing"), common_pb2.InferenceRequest(prompt="x"))
    assert DEFAULT_MAX_TOKENS_CEILING == 512
    assert params.max_tokens == 512
    assert (params.temperature, params.repetition_penalty) == (pytest.approx(0.8), pytest.approx(1.1))
    assert trace == [
        "tuning: task creative_writing -> temperature 0.8, max_tokens 4096, top_p 0.95, "
        "repetition_penalty 1.1 (the task-type table)",
        "tuning: max_tokens 512, the deployment's ceiling (EXPERT_ROUTER_MAX_TOKENS_DEFAULT), "
        "under the table's 4096",
    ]


def test_a_deployment_ceiling_applies_only_when_it_is_below_the_table_and_the_user_set_nothing():
    request = common_pb2.InferenceRequest(prompt="x")
    params, trace = tune_parameters(features(), request, max_tokens_ceiling=4096)
    assert params.max_tokens == 2048 and len(trace) == 1  # the table's 2048 is under the ceiling
    request.max_tokens = 3000
    params, trace = tune_parameters(features(), request, max_tokens_ceiling=256)
    assert params.max_tokens == 3000
    assert trace[-1] == "tuning: max_tokens = 3000 (user)"
    assert not any("ceiling" in line for line in trace)


def test_the_context_window_still_caps_below_the_ceiling():
    params, trace = tune_parameters(features(), common_pb2.InferenceRequest(prompt="x"), max_model_len=512)
    assert params.max_tokens == 256
    assert trace[-1] == "tuning: max_tokens capped at 256 (half the 512-token context)"


def test_the_models_generation_config_takes_precedence_over_the_table_and_the_user_over_both():
    defaults = common_pb2.SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20)
    request = common_pb2.InferenceRequest(prompt="x", top_p=0.5)
    params, trace = tune_parameters(features(), request, model_defaults=defaults)
    assert params.temperature == pytest.approx(0.7)
    assert params.top_k == 20
    assert params.repetition_penalty == pytest.approx(1.1)  # the file does not set it: the table's
    assert params.top_p == pytest.approx(0.5)  # the user's
    expected = "tuning: the model's generation_config.json sets temperature 0.7, top_p 0.8, top_k 20"
    assert f"{expected} (over the table)" in trace
    assert trace[-1] == "tuning: top_p = 0.5 (user)"


def test_an_empty_generation_config_changes_nothing():
    request = common_pb2.InferenceRequest(prompt="x")
    plain, plain_trace = tune_parameters(features(), request)
    same, trace = tune_parameters(features(), request, model_defaults=common_pb2.SamplingDefaults())
    assert same == plain and trace == plain_trace


def test_the_ceiling_is_configured_by_its_variable():
    assert RouterConfig.from_env({}).max_tokens_ceiling == 512
    assert RouterConfig.from_env({"EXPERT_ROUTER_MAX_TOKENS_DEFAULT": "128"}).max_tokens_ceiling == 128
    with pytest.raises(ConfigError, match="EXPERT_ROUTER_MAX_TOKENS_DEFAULT"):
        RouterConfig.from_env({"EXPERT_ROUTER_MAX_TOKENS_DEFAULT": "0"})


def test_the_users_n_and_logprobs_pass_through_untouched():
    request = common_pb2.InferenceRequest(prompt="x", n=3, logprobs=0)
    params, trace = tune_parameters(features(), request)
    assert params.n == 3 and params.HasField("logprobs") and params.logprobs == 0
    assert "tuning: n = 3 (user)" in trace and "tuning: logprobs = 0 (user)" in trace
    default, _ = tune_parameters(features(), common_pb2.InferenceRequest(prompt="x"))
    assert default.n == 0 and not default.HasField("logprobs")  # the engine's 1 choice, no logprobs


# A request with an output format (docs/design.md#structured-output) is a structured task.


@pytest.mark.parametrize(
    ("response_format", "task"),
    [
        ({"json_object": {}}, "json_parsing"),
        ({"json_schema": {"schema": '{"type": "object"}'}}, "json_parsing"),
        ({"regex": "[0-9]+"}, "structured_output"),
        ({"grammar": 'start: "yes" | "no"'}, "structured_output"),
    ],
)
def test_a_format_makes_the_task_structured_whatever_the_prompt_reads_as(response_format, task):
    prompt = "Write a poem about the sea"  # creative_writing by its words
    request = common_pb2.InferenceRequest(prompt=prompt, response_format=response_format)
    plan, _ = asyncio.run(Planner().plan(request))
    assert plan.features.task_type == task
    assert task in TASK_TYPES
    assert plan.generation_params.response_format == request.response_format  # for the engine
    params = plan.generation_params
    assert (params.temperature, params.repetition_penalty) == (pytest.approx(0.2), pytest.approx(1.0))
    kind = next(iter(response_format))
    lines = plan.reasoning_trace.splitlines()
    assert lines[0].endswith(
        f"task {task} (the request's {kind} format; the prompt reads as creative_writing)"
    )
    assert f"format: {kind} (the request's response_format), enforced by the engine as it samples" in lines


def test_the_json_schema_shorthand_is_planned_as_a_json_schema_format():
    request = common_pb2.InferenceRequest(prompt="Hello there", json_schema='{"type": "object"}')
    plan, _ = asyncio.run(Planner().plan(request))
    assert plan.features.task_type == "json_parsing"
    assert plan.generation_params.response_format == common_pb2.ResponseFormat(
        json_schema={"schema": '{"type": "object"}'}
    )
    assert "format: json_schema (the request's json_schema, the shorthand)" in plan.reasoning_trace


def test_without_a_format_the_prompt_decides_and_the_plan_carries_none():
    plan, _ = asyncio.run(Planner().plan(common_pb2.InferenceRequest(prompt="Write a poem about the sea")))
    assert plan.features.task_type == "creative_writing"
    assert not plan.generation_params.HasField("response_format")
    assert "format:" not in plan.reasoning_trace and "reads as" not in plan.reasoning_trace


def test_structured_output_is_tuned_as_json_parsing():
    structured, trace = tune_parameters(
        features("structured_output"), common_pb2.InferenceRequest(prompt="x")
    )
    json_task, _ = tune_parameters(features("json_parsing"), common_pb2.InferenceRequest(prompt="x"))
    assert structured == json_task
    assert trace[0].startswith("tuning: task structured_output -> temperature 0.2, max_tokens 2048")


def test_for_format_replaces_only_the_task_type():
    prompt = features("question_answering")
    assert for_format(prompt, None) is prompt
    assert for_format(prompt, "grammar") == Features("en", False, False, "structured_output")


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("temperature", 0.3, "0.3"),
        ("top_p", 0.1234567, "0.1234567"),
        ("min_p", 1e-05, "1e-05"),
        ("seed", 7, "7"),
    ],
)
def test_a_users_float32_value_is_traced_as_the_shortest_decimal_that_reads_back(field, value, shown):
    request = common_pb2.InferenceRequest(prompt="x", **{field: value})
    assert getattr(request, field) != value or field == "seed"  # float32: 0.3 is 0.30000001192092896 here
    _, trace = tune_parameters(features(), request)
    assert trace[-1] == f"tuning: {field} = {shown} (user)"


def test_the_users_ignore_eos_and_skip_special_tokens_go_into_the_plan():
    request = common_pb2.InferenceRequest(prompt="x", ignore_eos=True, skip_special_tokens=False)
    params, trace = tune_parameters(features(), request)
    assert params.ignore_eos and params.HasField("skip_special_tokens") and not params.skip_special_tokens
    assert "tuning: ignore_eos = True (user)" in trace
    assert not tune_parameters(features(), common_pb2.InferenceRequest(prompt="x"))[0].HasField(
        "skip_special_tokens"
    )
