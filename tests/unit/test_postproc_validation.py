"""Postproc's output validation (docs/design.md#post-processing), one test per rule, without a
server."""

from __future__ import annotations

import json

import pytest

from services.postproc.validation import unfence, validate_output

SCHEMA = json.dumps({"type": "object", "required": ["name"], "properties": {"age": {"type": "integer"}}})


def test_a_json_task_needs_json():
    assert validate_output('{"a": 1}', "json_parsing").valid
    bad = validate_output("{a: 1}", "json_parsing")
    assert (bad.valid, bad.validator) == (False, "json") and bad.error


def test_a_code_task_needs_python_that_parses():
    assert validate_output("def f(x):\n    return x\n", "code_generation").valid
    bad = validate_output("def f(x)\n    return x\n", "code_generation")
    assert (bad.valid, bad.validator) == (False, "python") and "line 1" in bad.error


@pytest.mark.parametrize("task", ["general", "summarization", "question_answering"])
def test_any_other_task_needs_non_empty_output(task):
    assert validate_output("Paris.", task).valid
    assert validate_output(" \n", task) == validate_output("", task)
    assert not validate_output("", task).valid and validate_output("", task).error == "empty output"


def test_a_schema_is_checked_whatever_the_task():
    assert validate_output('{"name": "Ana", "age": 41}', "general", SCHEMA).valid
    missing = validate_output('{"age": 41}', "general", SCHEMA)
    assert (missing.valid, missing.validator) == (False, "json_schema") and "'name'" in missing.error
    wrong = validate_output('{"name": "Ana", "age": "41"}', "json_parsing", SCHEMA)
    assert not wrong.valid and wrong.error.startswith("age:")
    assert "not JSON" in validate_output("Ana, 41", "general", SCHEMA).error


def test_an_invalid_schema_fails_validation_with_its_reason():
    result = validate_output("{}", "general", '{"type": 12}')
    assert not result.valid and "not a valid schema" in result.error


def test_one_markdown_fence_around_the_answer_is_looked_through():
    fenced = '```json\n{"name": "Ana"}\n```'
    assert unfence(fenced) == '{"name": "Ana"}'
    assert validate_output(fenced, "json_parsing").valid
    assert validate_output(fenced, "general", SCHEMA).valid
    assert validate_output("```python\nx = 1\n```", "code_generation").valid
    assert not validate_output('Here: ```json\n{"a": 1}\n```', "json_parsing").valid  # text around it


def test_what_is_nested_too_deeply_to_check_fails_instead_of_raising():
    looping = validate_output("{}", "general", '{"$ref": "#"}')
    assert (looping.valid, looping.validator, looping.error) == (
        False,
        "json_schema",
        "nested too deeply to check",
    )
    deep = validate_output("[" * 100_000, "json_parsing")
    assert (deep.valid, deep.validator) == (False, "json")
