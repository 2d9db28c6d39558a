"""The demo set trains through the trainer directly, with the settings its recipes name as
`expertctl expert train` options (the options its stamps record, and what a person would type);
the same recipes written as a training job's spec (the API's) name those settings too."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from libs.training.settings import TrainSettings
from libs.training.spec import parse_spec
from tools.demo.catalog import RECIPES, VERSION
from tools.expertctl.main import build_parser
from tools.expertctl.train_cmd import settings_from


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_recipe_trains_with_the_settings_its_flags_name(recipe):
    args = build_parser().parse_args(["expert", "train", "data.jsonl", "--out", "out", *recipe.train_flags()])
    assert recipe.settings() == settings_from(args)


def trained_with(settings: TrainSettings) -> TrainSettings:
    """The settings a run uses: LoRA's rank, alpha and dropout shape nothing else (libs.training.
    trainer.peft_config), and a job spec names them for LoRA only."""
    if settings.adapter_type == "lora":
        return settings
    default = TrainSettings()
    return replace(settings, rank=default.rank, alpha=default.alpha, dropout=default.dropout)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_recipe_as_a_job_spec_trains_with_its_settings_and_metadata(recipe):
    # What bench/training_api.py sends to POST /v1/training/jobs, read back as the admission reads it.
    spec = parse_spec(json.loads(json.dumps(recipe.job_spec("file-0123"))))
    assert spec.settings == trained_with(recipe.settings()) and spec.training_file == "file-0123"
    assert spec.expert.name == recipe.name and spec.expert.version == VERSION
    assert spec.expert.description == recipe.skill.description
    assert spec.expert.keywords == tuple(recipe.skill.keywords)
