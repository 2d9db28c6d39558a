"""The demo set's skills: seeded, disjoint splits, and metrics that give the reference answer full
marks and a wrong one none (the bench's lift figures rest on them)."""

from __future__ import annotations

import json

import pytest

from tools.demo.catalog import RECIPES, WrongJsonKeys
from tools.demo.dates import DateNormalisation
from tools.demo.json_extract import JsonExtraction
from tools.demo.sql import SqlQueries, answer_query, run_query
from tools.demo.units import UnitConversion

SKILLS = [recipe.skill for recipe in RECIPES]


@pytest.mark.parametrize("skill", SKILLS, ids=lambda s: s.name)
def test_the_split_is_seeded_and_the_test_prompts_never_train(skill):
    train, test = skill.splits(0, 60, 40)
    again, _ = skill.splits(0, 60, 40)
    assert [e.prompt for e in train] == [e.prompt for e in again]
    assert len({e.prompt for e in train}) == 60 and len({e.prompt for e in test}) == 40
    assert not {e.prompt for e in train} & {e.prompt for e in test}


@pytest.mark.parametrize(
    "skill", [s for s in SKILLS if not isinstance(s, WrongJsonKeys)], ids=lambda s: s.name
)
def test_the_reference_answer_scores_full_marks(skill):
    _, test = skill.splits(0, 1, 30)
    assert all(skill.score(e.completion, e) == 1.0 for e in test)
    assert all(skill.score("I am not sure.", e) == 0.0 for e in test)


def test_json_extraction_scores_field_by_field_and_forgives_a_fence():
    skill = JsonExtraction()
    (example,) = skill.splits(3, 1, 1)[1]
    answer = dict(example.reference)
    assert skill.score(f"```json\n{json.dumps(answer)}\n```", example) == 1.0
    first = next(iter(answer))
    answer[first] = "wrong"
    assert skill.score(json.dumps(answer), example) == pytest.approx(1 - 1 / len(answer))


def test_the_mislabelled_expert_learns_the_good_prompts_with_wrong_keys():
    good, bad = JsonExtraction(), WrongJsonKeys()
    good_train, _ = good.splits(0, 20, 10)
    bad_train, _ = bad.splits(0, 20, 10)
    assert [e.prompt for e in good_train] == [e.prompt for e in bad_train]
    for g, b in zip(good_train, bad_train, strict=True):
        assert set(json.loads(b.completion).values()) == set(json.loads(g.completion).values())
        assert not set(json.loads(b.completion)) & set(json.loads(g.completion))
        assert good.score(b.completion, g) == 0.0


def test_sql_answers_are_judged_by_their_rows():
    skill = SqlQueries()
    _, test = skill.splits(0, 1, 40)
    counting = next(e for e in test if e.completion.startswith("SELECT COUNT(*)"))
    rewritten = counting.completion.replace("COUNT(*)", "COUNT(id)")
    assert skill.score(f"```sql\n{rewritten}\n```", counting) == 1.0
    assert skill.score("DROP TABLE employees;", counting) == 0.0
    assert run_query("SELECT COUNT(*) FROM employees") == [(40,)]  # the drop did not happen
    assert answer_query("SELECT 1; SELECT 2;") == "SELECT 1"


def test_dates_and_units_are_exact_matches_of_the_first_line():
    dates = DateNormalisation()
    (example,) = dates.splits(0, 1, 1)[1]
    assert dates.score(f"{example.completion}\nThat is the ISO form.", example) == 1.0
    assert dates.score(f"The date is {example.completion}", example) == 0.0
    units = UnitConversion()
    (example,) = units.splits(0, 1, 1)[1]
    assert units.score(example.completion + ".", example) == 1.0
