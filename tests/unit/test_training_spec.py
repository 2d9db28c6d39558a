"""A training job's spec (libs.training.spec) and its bounds (libs.training.bounds): every problem
named by its field at once, defaults filled in, whole-model training refused by name, and the steps
a job takes counted as the trainer counts them."""

from __future__ import annotations

import pytest

from libs.training.bounds import TrainingBounds, bound_violations, planned_steps
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
            bounds,
            steps=101,
            max_steps_given=False,
            samples={"training_file": 51, "validation_file": 10},
            max_sequence_length=513,
            time_budget_seconds=61,
        )
    )
    assert set(problems) == {
        "training_file",
        "hyperparameters.epochs",
        "hyperparameters.max_sequence_length",
        "time_budget_seconds",
    }
    assert "EXPERT_TRAINING_MAX_STEPS" in problems["hyperparameters.epochs"]
    within = bound_violations(
        bounds,
        steps=100,
        max_steps_given=True,
        samples={"training_file": 50},
        max_sequence_length=None,
        time_budget_seconds=0,
    )
    assert within == []


def test_the_bounds_come_from_the_environment():
    bounds = TrainingBounds.from_env({"EXPERT_TRAINING_MAX_STEPS": "7", "EXPERT_TRAINING_MAX_SECONDS": "9"})
    assert (bounds.max_steps, bounds.max_seconds, bounds.max_samples) == (7, 9, 100_000)
