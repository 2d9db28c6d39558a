"""Output validation (docs/design.md#post-processing): JSON for JSON tasks (and a JSON schema when
the request carries one), Python syntax for code tasks, non-empty text otherwise."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

import jsonschema

# Models often fence their answer in markdown: validate what is inside a single fenced block.
_FENCE = re.compile(r"^\s*```[\w+-]*\n(.*?)\n```\s*$", re.DOTALL)


@dataclass(frozen=True)
class Validation:
    valid: bool
    validator: str  # json, json_schema, python, generic
    error: str = ""


def unfence(text: str) -> str:
    match = _FENCE.match(text)
    return match.group(1) if match else text.strip()


def validate_output(output: str, task_type: str, json_schema: str | None = None) -> Validation:
    try:
        return _validate(output, task_type, json_schema)
    except RecursionError:
        # An output nested thousands of levels deep, or a schema whose $ref loops without consuming
        # the document (`{"$ref": "#"}`): the parsers recurse, so the check cannot be made.
        validator = "json_schema" if json_schema is not None else _VALIDATORS.get(task_type, "generic")
        return Validation(False, validator, "nested too deeply to check")


_VALIDATORS = {"json_parsing": "json", "code_generation": "python"}


def _validate(output: str, task_type: str, json_schema: str | None) -> Validation:
    if json_schema is not None:
        return _validate_schema(output, json_schema)
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


def _validate_schema(output: str, schema_text: str) -> Validation:
    try:
        schema = json.loads(schema_text)
        jsonschema.Draft202012Validator.check_schema(schema)
    except (json.JSONDecodeError, jsonschema.SchemaError) as exc:
        return Validation(False, "json_schema", f"the request's json_schema is not a valid schema: {exc}")
    try:
        document = json.loads(unfence(output))
    except json.JSONDecodeError as exc:
        return Validation(False, "json_schema", f"not JSON: {exc}")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(document))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return Validation(False, "json_schema", f"{where}: {error.message}")
    return Validation(True, "json_schema")
