"""The llguidance grammar (Lark dialect) that enforces tool calls in a family's format.

`required` and a named function allow only calls (of any tool, or of the named one); `auto` allows
calls or plain text that does not start the way a call starts; `none` has no grammar. Each call is
the family's JSON envelope with the function's name as a constant and its parameter schema for
the arguments, so every call parses and validates against its schema; without parallel calls the
output is exactly one call.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass

from libs.structured_output import JSON_OPTIONS, only_declared
from libs.tools.families import ToolFamily

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionSpec:
    """A tool as the grammar needs it: its name and its parameter schema (a JSON object)."""

    name: str
    parameters: dict


def parameters_schema(text: str) -> dict:
    """A tool's parameter schema from its JSON text (empty: no arguments); ValueError if it is not
    a JSON object."""
    if not text:
        return dict(EMPTY_PARAMETERS)
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise ValueError(f"expected a JSON schema object, got {type(schema).__name__}")
    return schema


def call_schema(family: ToolFamily, function: FunctionSpec) -> dict:
    """The JSON schema of one call of `function` in the family's envelope. The parameters' `$defs`
    move to the envelope's root, where their `#/$defs/...` references resolve."""
    parameters = only_declared(copy.deepcopy(function.parameters))
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    arguments_key = "arguments" if family.format == "hermes" else "parameters"
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **definitions,
        "x-guidance": JSON_OPTIONS,
    }


def tool_grammar(
    family: ToolFamily, functions: Sequence[FunctionSpec], *, allow_text: bool, parallel: bool
) -> str:
    """The grammar of an output that calls `functions` (one of them per call)."""
    if not functions:
        raise ValueError("no function to call")
    if family.format == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        separator, text = '"\\n"', "TEXT: /[^<](?s:.*)/"
    else:
        call = "call: body"
        separator, text = '"; "', "TEXT: /[^{](?s:.*)/"
    calls = f"calls: call ({separator} call)*" if parallel else "calls: call"
    lines = [
        "start: calls | TEXT" if allow_text else "start: calls",
        calls,
        call,
        "body: " + " | ".join(f"body{i}" for i in range(len(functions))),
    ]
    lines += [f"body{i}: %json {json.dumps(call_schema(family, f))}" for i, f in enumerate(functions)]
    if allow_text:
        lines.append(text)
    return "\n".join(lines) + "\n"
