"""Output validation (docs/design.md#post-processing): an output with a format must be exactly a
text of that format; without one, JSON for JSON tasks, Python syntax for code tasks, non-empty text
otherwise; a choice of tool calls, arguments that are JSON objects.

The format check is postproc's own, independent of the engine that enforced the format while
sampling: a JSON output is parsed and checked against its schema with jsonschema, a regex or grammar
output is read byte by byte against the format (libs.structured_output.text_problem), never through
the engine's token matcher.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jsonschema

from libs.gen.expert.v1 import common_pb2
from libs.structured_output import StructuredOutput, text_problem

# Models often fence their answer in markdown: validate what is inside a single fenced block.
_FENCE = re.compile(r"^\s*```[\w+-]*\n(.*?)\n```\s*$", re.DOTALL)


@dataclass(frozen=True)
class Validation:
    valid: bool
    # json_schema (a JSON object or schema format), regex, grammar (those formats); without a
    # format: json, python, generic
    validator: str
    error: str = ""


def unfence(text: str) -> str:
    match = _FENCE.match(text)
    return match.group(1) if match else text.strip()


def validate_output(
    output: str,
    task_type: str,
    output_format: StructuredOutput | None = None,
    *,
    cut_by_max_tokens: bool = False,
) -> Validation:
    """The check of one output: against its format when the request had one (an output that
    max_tokens cut is not valid then, whatever its text), else by the task type."""
    validator = _validator(task_type, output_format)
    try:
        if output_format is None:
            return _validate_task(output, task_type)
        problem = _format_problem(output, output_format)
    except RecursionError:
        # An output nested thousands of levels deep, or a schema whose $ref loops without consuming
        # the document (`{"$ref": "#"}`): the parsers recurse, so the check cannot be made.
        return Validation(False, validator, "nested too deeply to check")
    if cut_by_max_tokens:
        # The engine stopped the output at max_tokens, not where the format let it end: a text
        # that happens to match (a regex's digits, say) is only the beginning of the one meant.
        cut = "cut by max_tokens (finish_reason length) before the format ended"
        return Validation(False, validator, f"{cut}: {problem}" if problem else cut)
    return Validation(problem is None, validator, problem or "")


def validate_calls(calls: Sequence[common_pb2.ToolCall]) -> Validation:
    """A choice that ended as tool calls (its text, the content, is empty): each call's arguments
    must be a JSON object. The functions' schemas stay with the engine, which enforced them while
    sampling (docs/api.md#tool-calling)."""
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError as exc:
            return Validation(False, "tool_calls", f"tool_calls[{i}].arguments: not JSON: {exc}")
        if not isinstance(arguments, dict):
            return Validation(False, "tool_calls", f"tool_calls[{i}].arguments: not a JSON object")
    return Validation(True, "tool_calls")


def _validator(task_type: str, output_format: StructuredOutput | None) -> str:
    if output_format is None:
        return _VALIDATORS.get(task_type, "generic")
    return "json_schema" if output_format.is_json else output_format.kind


_VALIDATORS = {"json_parsing": "json", "code_generation": "python"}


def _validate_task(output: str, task_type: str) -> Validation:
    if task_type == "json_parsing":
        try:
            json.loads(unfence(output))
        except json.JSONDecodeError as exc:
            return Validation(False, "json", str(exc))
        return Validation(True, "json")
    if task_type == "code_generation":
        try:
            ast.parse(unfence(output))
        except SyntaxError as exc:
            return Validation(False, "python", f"{exc.msg} (line {exc.lineno})")
        return Validation(True, "python")
    if output.strip():
        return Validation(True, "generic")
    return Validation(False, "generic", "empty output")


def _format_problem(output: str, output_format: StructuredOutput) -> str | None:
    """Why the output is not a text of its format, or None. The engine generated it under the
    format, so it is checked as it is: no fence is looked through."""
    if output_format.is_json:
        return _schema_problem(output, output_format.schema_text)
    return text_problem(output_format, output)


def _schema_problem(output: str, schema_text: str) -> str | None:
    try:
        schema = json.loads(schema_text)
        jsonschema.Draft202012Validator.check_schema(schema)
    except (json.JSONDecodeError, jsonschema.SchemaError) as exc:
        return f"the request's json_schema is not a valid schema: {exc}"
    try:
        document = json.loads(output)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(document))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"{where}: {error.message}"
    return None
