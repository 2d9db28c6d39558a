"""A training job's spec (libs.training.spec) and its bounds (libs.training.bounds): every problem
named by its field at once, defaults filled in, whole-model training refused by name, and the steps
a job takes counted as the trainer counts them; every ceiling (fixed, and the deployment's
EXPERT_TRAINING_MAX_*) named by its field; a job's record holding only JSON."""

from __future__ import annotations

import json
import math

import pytest

from libs.config import ConfigError
from libs.training.bounds import TrainingBounds, bound_violations, planned_steps, setting_violations
from libs.training.job_json import read_json, to_json
from libs.training.settings import SettingsError, TrainSettings
from libs.training.spec import SpecError, parse_spec

MINIMAL = {"training_file": "file-abc", "expert": {"name": "shouter"}}


def test_a_minimal_spec_takes_the_defaults():
    spec = parse_spec(MINIMAL)
    assert spec.settings.adapter_type == "lora" and spec.settings.epochs == 3
    assert spec.expert.version == "1.0.0"
    shown = spec.to_dict()
    assert shown["adapter"] == {"type": "lora", "rank": 8, "alpha": 16.0, "dropout": 0.05}
    assert shown["hyperparameters"]["learning_rate"] == 1e-3
    assert parse_spec(shown).to_dict() == shown  # the stored form reads back the same


def test_prompt_tuning_is_spelled_with_an_underscore():
    spec = parse_spec({**MINIMAL, "adapter": {"type": "prompt_tuning", "num_virtual_tokens": 4}})
    assert spec.settings.adapter_type == "prompt-tuning" and spec.settings.num_virtual_tokens == 4
    assert spec.to_dict()["adapter"] == {"type": "prompt_tuning", "num_virtual_tokens": 4}


def test_every_problem_is_named_by_its_field():
    with pytest.raises(SpecError) as refused:
        parse_spec(
            {
                "expert": {"name": ""},
                "adapter": {"type": "full", "rank": 0},
                "hyperparameters": {"epochs": "three", "dropout": 0.1, "learning_rate": -1.0},
                "parallelism_config": {"tensor_parallel_size": 8},
                "memory_config": {"zero_stage": 3},
            }
        )
    fields = [field for field, _ in refused.value.violations]
    assert fields == [
        "parallelism_config",
        "memory_config",
        "hyperparameters.dropout",
        "training_file",
        "expert.name",
        "adapter.type",
        "adapter.rank",
        "hyperparameters.epochs",
        "hyperparameters.learning_rate",
    ]
    reasons = dict(refused.value.violations)
    assert "out of scope" in reasons["parallelism_config"] and "ZeRO" in reasons["memory_config"]
    assert "unknown field" in reasons["hyperparameters.dropout"]


def test_a_spec_must_be_an_object():
    with pytest.raises(SpecError) as refused:
        parse_spec(["not", "an", "object"])
    assert refused.value.violations[0] == ("job", "must be an object")


def test_the_steps_are_counted_as_the_trainer_counts_them():
    # 40 samples, a tenth held out: 36 train, 2 a step, 3 epochs.
    assert planned_steps(40, False, 3, 2, 0.1) == 54
    assert planned_steps(40, True, 3, 2, 0.1) == 60  # a validation file: every sample trains
    assert planned_steps(5, False, 1, 8, 0.0) == 1


def test_a_job_over_each_bound_is_named():
    bounds = TrainingBounds(max_steps=100, max_samples=50, max_sequence_length=512, max_seconds=60)
    problems = dict(
        bound_violations(
            bounds, steps=101, max_steps_given=False, samples={"training_file": 51, "validation_file": 10}
        )
    )
    assert set(problems) == {"training_file", "hyperparameters.epochs"}
    assert "EXPERT_TRAINING_MAX_STEPS" in problems["hyperparameters.epochs"]
    within = bound_violations(bounds, steps=100, max_steps_given=True, samples={"training_file": 50})
    assert within == []
    stored = parse_spec(
        {
            **MINIMAL,
            "hyperparameters": {"max_sequence_length": 513},
            "time_budget_seconds": 61,
            "checkpoint_every_steps": 101,
        }
    ).to_dict()
    problems = dict(setting_violations(bounds, stored))
    assert set(problems) == {
        "hyperparameters.max_sequence_length",
        "time_budget_seconds",
        "checkpoint_every_steps",
    }
    assert "EXPERT_TRAINING_MAX_SECONDS" in problems["time_budget_seconds"]


def test_the_bounds_come_from_the_environment():
    bounds = TrainingBounds.from_env({"EXPERT_TRAINING_MAX_STEPS": "7", "EXPERT_TRAINING_MAX_SECONDS": "9"})
    assert (bounds.max_steps, bounds.max_seconds, bounds.max_samples) == (7, 9, 100_000)


def test_the_fixed_ceilings_hold_for_every_training_run():
    for changes, option in (
        ({"alpha": 1e308}, "--alpha"),
        ({"learning_rate": 2.0}, "--lr"),
        ({"num_virtual_tokens": 10**9}, "--virtual-tokens"),
        ({"seed": 2**40}, "--seed"),
        ({"target_modules": ("nope",)}, "--target-modules"),
        ({"adapter_type": "ia3", "feedforward_modules": ("down_proj",)}, "--feedforward-modules"),
    ):
        with pytest.raises(SettingsError, match=option):
            TrainSettings(**changes)


def test_every_problem_of_a_spec_over_the_fixed_ceilings_is_named_at_once():
    with pytest.raises(SpecError) as refused:
        parse_spec(
            {
                **MINIMAL,
                "adapter": {"rank": 2**63, "alpha": 10**400, "target_modules": ["q_proj", "nope"]},
                "hyperparameters": {"learning_rate": 1e308, "seed": -1, "patience": 2**40},
                "expert": {"name": "A B/../x", "version": "1." * 500, "description": "d" * 2001},
            }
        )
    fields = {field for field, _ in refused.value.violations}
    assert fields == {
        "adapter.rank",
        "adapter.alpha",
        "adapter.target_modules",
        "hyperparameters.learning_rate",
        "hyperparameters.seed",
        "hyperparameters.patience",
        "expert.name",
        "expert.version",
        "expert.description",
    }
    assert all(len(reason) < 300 for _, reason in refused.value.violations)


def test_the_deployments_ceilings_come_from_the_environment_and_are_named():
    bounds = TrainingBounds.from_env(
        {
            "EXPERT_TRAINING_MAX_RANK": "16",
            "EXPERT_TRAINING_MAX_EPOCHS": "4",
            "EXPERT_TRAINING_MAX_BATCH_SIZE": "2",
        }
    )
    assert (bounds.max_rank, bounds.max_epochs, bounds.max_batch_size) == (16, 4, 2)
    over = {
        **MINIMAL,
        "adapter": {"rank": 17},
        "hyperparameters": {"epochs": 5, "batch_size": 3, "patience": 5},
    }
    problems = dict(setting_violations(bounds, parse_spec(over).to_dict()))
    assert set(problems) == {
        "adapter.rank",
        "hyperparameters.epochs",
        "hyperparameters.batch_size",
        "hyperparameters.patience",
    }
    assert "EXPERT_TRAINING_MAX_RANK" in problems["adapter.rank"]
    with pytest.raises(ConfigError):
        TrainingBounds.from_env({"EXPERT_TRAINING_MAX_STEPS": str(2**31)})  # past what gRPC carries


def test_a_record_holds_only_json_and_an_older_one_reads_leniently():
    assert json.loads(to_json({"train_loss": math.nan, "eta": math.inf, "step": 3})) == {
        "train_loss": None,
        "eta": None,
        "step": 3,
    }
    assert read_json('{"learning_rate": 1e400, "loss": NaN, "ok": 1.5}') == {
        "learning_rate": None,
        "loss": None,
        "ok": 1.5,
    }
    assert read_json('{"description": "\\ud800"}') is None
    assert read_json("[" * 10_000) is None
