"""The validation rules of tool calling (docs/api.md#tool-calling): the tools (OpenAI's name rule,
a JSON schema object for the parameters, the limits in libs.limits), a tool_choice that names a
defined function, the calls and results in the conversation, and the grammar the engine will
compile, checked here so that a tool the engine cannot enforce is refused before the job is queued."""

from __future__ import annotations

import json
import re

from libs.gen.expert.v1 import common_pb2
from libs.limits import MAX_TOOL_DESCRIPTION_CHARS, MAX_TOOL_NAME_CHARS, MAX_TOOLS, MAX_TOOLS_BYTES
from libs.structured_output import StructuredOutput, format_problem
from libs.tools.families import FALLBACK
from libs.tools.grammar import FunctionSpec, tool_grammar
from libs.utf8 import undecodable

_NAME = re.compile(rf"[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME_CHARS}}}")
_NAME_RULE = f"1-{MAX_TOOL_NAME_CHARS} of a-z, A-Z, 0-9, _ and -"

Problems = list[tuple[str, str]]


def tool_problems(request: common_pb2.InferenceRequest, schema_problems) -> Problems:
    """Every problem of the request's tools, tool_choice and tool messages. `schema_problems(text,
    field)` is reception's check of a JSON schema (validation.py's, shared with response_format)."""
    problems = _tools(request, schema_problems) + _choice(request) + _history(request)
    enabled = request.tools and _mode(request) != common_pb2.TOOL_CHOICE_MODE_NONE
    if enabled and (request.HasField("response_format") or request.HasField("json_schema")):
        problems.append(
            ("request.response_format", "set either tools (with a tool_choice other than none) or a format")
        )
    if request.tools and request.raw:
        problems.append(("request.raw", "a raw completion cannot offer tools"))
    if enabled and not problems:
        problems += _grammar(request)
    return problems


def _mode(request: common_pb2.InferenceRequest) -> int:
    choice = request.tool_choice
    return choice.mode if choice.WhichOneof("choice") == "mode" else common_pb2.TOOL_CHOICE_MODE_AUTO


def _tools(request: common_pb2.InferenceRequest, schema_problems) -> Problems:
    problems: Problems = []
    if len(request.tools) > MAX_TOOLS:
        return [("request.tools", f"at most {MAX_TOOLS} tools, got {len(request.tools)}")]
    total = sum(len(t.parameters.encode()) for t in request.tools)
    if total > MAX_TOOLS_BYTES:
        return [
            (
                "request.tools",
                f"the parameter schemas take {total} bytes, above the limit of {MAX_TOOLS_BYTES}",
            )
        ]
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        field = f"request.tools[{i}]"
        if not _NAME.fullmatch(tool.name):
            problems.append((f"{field}.name", f"must be {_NAME_RULE}, got {tool.name[:80]!r}"))
        elif tool.name in seen:
            problems.append((f"{field}.name", f"{tool.name!r} is defined twice"))
        seen.add(tool.name)
        if len(tool.description) > MAX_TOOL_DESCRIPTION_CHARS:
            problems.append(
                (
                    f"{field}.description",
                    f"at most {MAX_TOOL_DESCRIPTION_CHARS} characters, got {len(tool.description)}",
                )
            )
        if tool.parameters:
            problems += _parameters(tool.parameters, f"{field}.parameters", schema_problems)
    return problems


def _parameters(text: str, field: str, schema_problems) -> Problems:
    problems = schema_problems(text, field)
    if problems:
        return problems
    schema = json.loads(text)
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return [(field, "must be a JSON schema of an object (type object)")]
    return []


def _choice(request: common_pb2.InferenceRequest) -> Problems:
    if not request.HasField("tool_choice"):
        return []
    choice = request.tool_choice
    kind = choice.WhichOneof("choice")
    if kind is None or (kind == "mode" and choice.mode == common_pb2.TOOL_CHOICE_MODE_UNSPECIFIED):
        return [("request.tool_choice", "set a mode (none, auto, required) or a function")]
    names = {t.name for t in request.tools}
    if kind == "function" and choice.function not in names:
        defined = ", ".join(sorted(names)) or "none"
        return [
            (
                "request.tool_choice.function",
                f"{choice.function!r} is not one of the tools (defined: {defined})",
            )
        ]
    if kind == "mode" and choice.mode == common_pb2.TOOL_CHOICE_MODE_REQUIRED and not names:
        return [("request.tool_choice", "required needs tools")]
    return []


def _history(request: common_pb2.InferenceRequest) -> Problems:
    """Calls only on assistant messages, each with a name and its arguments as a JSON object."""
    problems: Problems = []
    for i, message in enumerate(request.messages):
        if message.tool_calls and message.role != "assistant":
            problems.append(
                (
                    f"request.messages[{i}].tool_calls",
                    f"only an assistant message has tool_calls, not {message.role!r}",
                )
            )
        for j, call in enumerate(message.tool_calls):
            field = f"request.messages[{i}].tool_calls[{j}]"
            if not call.name:
                problems.append((f"{field}.name", "must not be empty"))
            problems += _arguments(call.arguments, f"{field}.arguments")
    return problems


def _arguments(text: str, field: str) -> Problems:
    """A call's arguments: a JSON object whose text (escapes decoded) UTF-8 can hold, since the
    engine decodes them to render the conversation (a lone surrogate there is the client's error,
    refused here rather than failing in the engine's tokenizer)."""
    try:
        arguments = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        return [(field, f"not JSON: {exc}")]
    if not isinstance(arguments, dict):
        return [(field, "must be a JSON object")]
    found = undecodable(arguments, "")
    return [] if found is None else [(field, f"{found[1]} (decoded, at {found[0] or 'a key'})")]


def _grammar(request: common_pb2.InferenceRequest) -> Problems:
    """The grammar of the calls, compiled once here (in the fallback's envelope: every family's
    differs only around the arguments), so a schema llguidance cannot enforce is refused now."""
    if request.tool_choice.WhichOneof("choice") == "function":
        tools = [t for t in request.tools if t.name == request.tool_choice.function]
    else:
        tools = list(request.tools)
    functions = [
        FunctionSpec(t.name, json.loads(t.parameters) if t.parameters else {"type": "object"}) for t in tools
    ]
    grammar = tool_grammar(FALLBACK, functions, allow_text=True, parallel=True)
    problem = format_problem(StructuredOutput("grammar", grammar), max_bytes=4 * MAX_TOOLS_BYTES)
    return [] if problem is None else [("request.tools", f"cannot be enforced: {problem}")]
