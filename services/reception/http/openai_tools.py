"""Tool calling in OpenAI's chat shape (docs/api.md#tool-calling), into the InferenceRequest:
`tools` (`{"type": "function", "function": {name, description, parameters, strict}}`),
`tool_choice` (`none`, `auto`, `required` or `{"type": "function", "function": {"name"}}`),
`parallel_tool_calls`, and a message's `name`, `tool_call_id` and `tool_calls`. A bad shape is a
400 naming the exact part; the rules on the values (names, schemas, a tool_choice that names a
defined tool) are reception's validation, whose violations name the same parts (errors.param_of).
The deprecated `functions` (a list of functions) and `function_call` (`none`, `auto` or
`{"name"}`) are mapped onto tools and a tool_choice of one call at most, as OpenAI still accepts
them; an assistant message's `function_call` becomes its one call and a `function` message a tool
result. A request that mixes the two forms is refused, naming the deprecated field.
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
    if body.legacy_functions:
        _add_functions(request, body)
        return
    for i, tool in enumerate(body.tools or []):
        request.tools.append(_tool(tool, f"tools[{i}]"))
    if body.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls


def _add_functions(request: common_pb2.InferenceRequest, body: ChatCompletionRequest) -> None:
    """The deprecated form: `functions` as the tools, `function_call` as the tool_choice, and one
    call at most (the form has no parallel calls)."""
    for legacy, modern in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, legacy) is not None and (body.tools is not None or body.tool_choice is not None):
            raise _bad(
                legacy,
                "is the deprecated form of tools and tool_choice: set either tools and tool_choice "
                "or functions and function_call, not both",
            )
        if getattr(body, legacy) is not None and body.parallel_tool_calls is not None:
            raise _bad(legacy, f"has one call at most: parallel_tool_calls goes with {modern}")
    for i, function in enumerate(body.functions or []):
        request.tools.append(_function(function, f"functions[{i}]"))
    if body.function_call is not None:
        request.tool_choice.CopyFrom(_function_call(body.function_call))
    request.parallel_tool_calls = False


def _function_call(value: Any) -> common_pb2.ToolChoice:
    if value in ("none", "auto"):
        return common_pb2.ToolChoice(mode=_MODES[value])
    if isinstance(value, dict) and set(value) == {"name"} and isinstance(value["name"], str):
        return common_pb2.ToolChoice(function=value["name"])
    raise _bad("function_call", f'must be none, auto or {{"name": ...}}, got {value!r}')


def _tool(value: Any, param: str) -> common_pb2.Tool:
    if not isinstance(value, dict) or value.get("type") != "function":
        raise _bad(f"{param}.type", "must be 'function' (the one tool type chat completions has)")
    for key in sorted(set(value) - {"type", "function"}):
        raise _bad(f"{param}.{key}", "is not an argument of a function tool", "unknown_parameter")
    function = value.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{param}.function", "must be an object with name, description and parameters")
    return _function(function, f"{param}.function")


def _function(function: Any, param: str) -> common_pb2.Tool:
    """A function (`{name, description, parameters, strict}`) as a Tool; `param` names it."""
    if not isinstance(function, dict):
        raise _bad(param, "must be an object with name, description and parameters")
    for key in sorted(set(function) - _FUNCTION_KEYS):
        raise _bad(f"{param}.{key}", "is not an argument of a function", "unknown_parameter")
    name, description = function.get("name"), function.get("description", "")
    if not isinstance(name, str):
        raise _bad(f"{param}.name", "must be a string")
    if not isinstance(description, str):
        raise _bad(f"{param}.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{param}.parameters", "must be a JSON schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{param}.strict", "must be true or false")
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
    """A message's name, tool_call_id and tool_calls (or deprecated function_call) onto its
    ChatMessage."""
    if message.name is not None:
        chat_message.name = message.name
    if message.tool_call_id is not None:
        chat_message.tool_call_id = message.tool_call_id
    for j, call in enumerate(message.tool_calls or []):
        chat_message.tool_calls.append(_call(call, f"messages[{index}].tool_calls[{j}]"))
    if message.function_call is not None:
        param = f"messages[{index}].function_call"
        if message.tool_calls or message.role != "assistant":
            raise _bad(param, "is an assistant's one call, not with tool_calls")
        chat_message.tool_calls.append(_function_of_call(message.function_call, param, legacy_call_id(index)))


def legacy_call_id(index: int) -> str:
    """The id given to the deprecated function_call of message `index` (the form has none)."""
    return f"call_function_{index}"


def function_result_ids(messages: list[Message]) -> dict[int, str]:
    """For each `function` message (a deprecated function_call's result), the id of the call it
    answers: the last function_call before it of the function it names ("" when there is none)."""
    last_call: dict[str, str] = {}
    ids: dict[int, str] = {}
    for i, message in enumerate(messages):
        call = message.function_call
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            last_call[call["name"]] = legacy_call_id(i)
        elif message.role == "function":
            ids[i] = last_call.get(message.name or "", "")
    return ids


def _call(value: Any, param: str) -> common_pb2.ToolCall:
    if not isinstance(value, dict):
        raise _bad(param, "must be an object with id, type and function")
    function = value.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{param}.function", "must be an object with name and arguments")
    call_id = value.get("id", "")
    if not isinstance(call_id, str):
        raise _bad(f"{param}.id", "must be a string")
    return _function_of_call(function, f"{param}.function", call_id)


def _function_of_call(function: Any, param: str, call_id: str) -> common_pb2.ToolCall:
    """A call's function (`{name, arguments}`), `param` naming it."""
    if not isinstance(function, dict):
        raise _bad(param, "must be an object with name and arguments")
    name, arguments = function.get("name"), function.get("arguments", "")
    if not isinstance(name, str):
        raise _bad(f"{param}.name", "must be a string")
    if not isinstance(arguments, str):
        raise _bad(f"{param}.arguments", "must be a string (the arguments as JSON text)")
    return common_pb2.ToolCall(id=call_id, type="function", name=name, arguments=arguments)
