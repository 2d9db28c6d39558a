"""The router's parameter tuning: the task-type table, the model's generation_config.json over it, the
deployment's ceiling on the default max_tokens, the context window, then the user's values; each
decision is a trace line."""

from __future__ import annotations

import pytest

from libs.config import ConfigError
from libs.gen.expert.v1 import common_pb2
from services.router.config import RouterConfig
from services.router.features import Features
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
