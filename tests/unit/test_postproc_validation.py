"""Postproc's output validation (docs/design.md#post-processing), one test per rule, without a
server: by the output's format when the request had one, else by the task type; a choice of tool
calls by its calls."""

from __future__ import annotations

import json

import pytest

from libs.gen.expert.v1 import common_pb2
from libs.structured_output import StructuredOutput
from services.postproc.validation import unfence, validate_calls, validate_output

SCHEMA = json.dumps({"type": "object", "required": ["name"], "properties": {"age": {"type": "integer"}}})
SCHEMA_FORMAT = StructuredOutput("json_schema", SCHEMA)


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
    assert validate_output('{"name": "Ana", "age": 41}', "general", SCHEMA_FORMAT).valid
    missing = validate_output('{"age": 41}', "general", SCHEMA_FORMAT)
    assert (missing.valid, missing.validator) == (False, "json_schema") and "'name'" in missing.error
    wrong = validate_output('{"name": "Ana", "age": "41"}', "json_parsing", SCHEMA_FORMAT)
    assert not wrong.valid and wrong.error.startswith("age:")
    assert "not JSON" in validate_output("Ana, 41", "general", SCHEMA_FORMAT).error


def test_an_invalid_schema_fails_validation_with_its_reason():
    result = validate_output("{}", "general", StructuredOutput("json_schema", '{"type": 12}'))
    assert not result.valid and "not a valid schema" in result.error


def test_one_markdown_fence_around_the_answer_is_looked_through_without_a_format():
    fenced = '```json\n{"name": "Ana"}\n```'
    assert unfence(fenced) == '{"name": "Ana"}'
    assert validate_output(fenced, "json_parsing").valid
    assert validate_output("```python\nx = 1\n```", "code_generation").valid
    assert not validate_output('Here: ```json\n{"a": 1}\n```', "json_parsing").valid  # text around it


def test_an_output_with_a_format_is_checked_as_it_is_without_looking_through_a_fence():
    fenced = validate_output('```json\n{"name": "Ana"}\n```', "json_parsing", SCHEMA_FORMAT)
    assert (fenced.valid, fenced.validator) == (False, "json_schema") and "not JSON" in fenced.error


def test_a_json_object_format_needs_an_object():
    any_object = StructuredOutput("json_object")
    assert validate_output('{"a": [1, 2]}', "general", any_object) == validate_output(
        "{}", "general", any_object
    )
    assert validate_output("{}", "general", any_object).validator == "json_schema"
    array = validate_output("[1, 2]", "general", any_object)
    assert not array.valid and array.error == "(root): [1, 2] is not of type 'object'"


def test_a_regex_format_needs_the_whole_output_to_match():
    phone = StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}")
    assert validate_output("555-0123", "general", phone) == validate_output("555-0199", "general", phone)
    assert validate_output("555-0123", "general", phone).validator == "regex"
    tail = validate_output("555-0123 ok", "general", phone)
    assert (tail.valid, tail.validator) == (False, "regex") and tail.error.startswith(
        "does not match from byte 8"
    )
    short = validate_output("555-01", "general", phone)
    assert not short.valid and short.error == "ends before the format is complete"


def test_a_grammar_format_needs_a_sentence_of_its_start_rule():
    answer = StructuredOutput("grammar", 'start: "Answer: " ("yes" | "no")')
    assert validate_output("Answer: yes", "general", answer).valid
    other = validate_output("Answer: maybe", "general", answer)
    assert (other.valid, other.validator) == (False, "grammar") and "does not match" in other.error


@pytest.mark.parametrize(
    ("output_format", "text"),
    [
        (StructuredOutput("regex", "[0-9]+"), "123"),  # matches, but the engine meant more digits
        (StructuredOutput("regex", "[0-9]+"), "12a"),
        (StructuredOutput("json_object"), '{"a": 1}'),
        (StructuredOutput("json_object"), '{"a": '),
    ],
)
def test_an_output_with_a_format_cut_by_max_tokens_is_not_valid(output_format, text):
    cut = validate_output(text, "general", output_format, cut_by_max_tokens=True)
    assert not cut.valid
    assert cut.error.startswith("cut by max_tokens (finish_reason length) before the format ended")
    whole = validate_output(text, "general", output_format)
    assert cut.error.endswith(whole.error)  # the text's own problem follows, when it has one


def test_an_output_without_a_format_cut_by_max_tokens_is_checked_as_usual():
    assert validate_output("Paris is", "general", cut_by_max_tokens=True).valid


def test_what_is_nested_too_deeply_to_check_fails_instead_of_raising():
    looping = validate_output("{}", "general", StructuredOutput("json_schema", '{"$ref": "#"}'))
    assert (looping.valid, looping.validator, looping.error) == (
        False,
        "json_schema",
        "nested too deeply to check",
    )
    deep = validate_output("[" * 100_000, "json_parsing")
    assert (deep.valid, deep.validator) == (False, "json")


def test_a_choice_of_tool_calls_needs_arguments_that_are_json_objects():
    def call(arguments: str) -> common_pb2.ToolCall:
        return common_pb2.ToolCall(id="call_a", name="f", arguments=arguments)

    assert validate_calls([call('{"a": 1}'), call("{}")]) == validate_calls([call("{}")])
    assert validate_calls([call("{}")]).valid and validate_calls([call("{}")]).validator == "tool_calls"
    assert validate_calls([call("{}"), call('{"a": ')]).error.startswith("tool_calls[1].arguments: not JSON")
    assert validate_calls([call("[1]")]).error == "tool_calls[0].arguments: not a JSON object"
