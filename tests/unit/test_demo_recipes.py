"""The demo set trains through the trainer directly, with the settings its recipes name as
`expertctl expert train` options (the options its stamps record, and what a person would type)."""

from __future__ import annotations

import pytest

from tools.demo.catalog import RECIPES
from tools.expertctl.main import build_parser
from tools.expertctl.train_cmd import settings_from


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_recipe_trains_with_the_settings_its_flags_name(recipe):
    args = build_parser().parse_args(["expert", "train", "data.jsonl", "--out", "out", *recipe.train_flags()])
    assert recipe.settings() == settings_from(args)
