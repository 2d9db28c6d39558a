"""Tool calling in OpenAI's chat shape (docs/api.md#tool-calling), into the InferenceRequest:
`tools` (`{"type": "function", "function": {name, description, parameters, strict}}`),
`tool_choice` (`none`, `auto`, `required` or `{"type": "function", "function": {"name"}}`),
`parallel_tool_calls`, and a message's `name`, `tool_call_id` and `tool_calls`. A bad shape is a
400 naming the exact part; the rules on the values (names, schemas, a tool_choice that names a
defined tool) are reception's validation, whose violations name the same parts (errors.param_of).
The deprecated `functions` and `function_call` are refused, naming the field that replaces them.
"""

from __future__ import annotations

import json
from typing import Any

from libs.gen.expert.v1 import common_pb2
from services.reception.http.errors import HttpError
from services.reception.http.openai_schema import ChatCompletionRequest, Message

_MODES = {
    "none": common_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": common_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": common_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def _bad(param: str, message: str, code: str = "invalid_value") -> HttpError:
    return HttpError(400, f"{param} {message}", param, code)


def add_tools(request: common_pb2.InferenceRequest, body: ChatCompletionRequest) -> None:
    """The body's tools, tool_choice and parallel_tool_calls onto the request (`tools: []` is no
    tools, as OpenAI has it)."""
    for name, replacement in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, name) is not None:
            raise _bad(name, f"is deprecated and not supported: use {replacement}", "unsupported_parameter")
    for i, tool in enumerate(body.tools or []):
        request.tools.append(_tool(tool, f"tools[{i}]"))
    if body.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls


def _tool(value: Any, param: str) -> common_pb2.Tool:
    if not isinstance(value, dict) or value.get("type") != "function":
        raise _bad(f"{param}.type", "must be 'function' (the one tool type chat completions has)")
    for key in sorted(set(value) - {"type", "function"}):
        raise _bad(f"{param}.{key}", "is not an argument of a function tool", "unknown_parameter")
    function = value.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{param}.function", "must be an object with name, description and parameters")
    for key in sorted(set(function) - _FUNCTION_KEYS):
        raise _bad(f"{param}.function.{key}", "is not an argument of a function", "unknown_parameter")
    name, description = function.get("name"), function.get("description", "")
    if not isinstance(name, str):
        raise _bad(f"{param}.function.name", "must be a string")
    if not isinstance(description, str):
        raise _bad(f"{param}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{param}.function.parameters", "must be a JSON schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{param}.function.strict", "must be true or false")
    return common_pb2.Tool(
        name=name,
        description=description,
        parameters=json.dumps(parameters) if parameters is not None else "",
        strict=bool(strict),
    )


def _tool_choice(value: Any) -> common_pb2.ToolChoice:
    if isinstance(value, str):
        if value not in _MODES:
            raise _bad("tool_choice", f"must be one of none, auto, required or a function, got {value!r}")
        return common_pb2.ToolChoice(mode=_MODES[value])
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(
            "tool_choice", 'must be none, auto, required or {"type": "function", "function": {"name": ...}}'
        )
    return common_pb2.ToolChoice(function=function["name"])


def message_tool_fields(message: Message, chat_message: common_pb2.ChatMessage, index: int) -> None:
    """A message's name, tool_call_id and tool_calls onto its ChatMessage."""
    if message.name is not None:
        chat_message.name = message.name
    if message.tool_call_id is not None:
        chat_message.tool_call_id = message.tool_call_id
    for j, call in enumerate(message.tool_calls or []):
        chat_message.tool_calls.append(_call(call, f"messages[{index}].tool_calls[{j}]"))


def _call(value: Any, param: str) -> common_pb2.ToolCall:
    if not isinstance(value, dict):
        raise _bad(param, "must be an object with id, type and function")
    function = value.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{param}.function", "must be an object with name and arguments")
    name, arguments = function.get("name"), function.get("arguments", "")
    if not isinstance(name, str):
        raise _bad(f"{param}.function.name", "must be a string")
    if not isinstance(arguments, str):
        raise _bad(f"{param}.function.arguments", "must be a string (the arguments as JSON text)")
    call_id = value.get("id", "")
    if not isinstance(call_id, str):
        raise _bad(f"{param}.id", "must be a string")
    return common_pb2.ToolCall(id=call_id, type="function", name=name, arguments=arguments)
