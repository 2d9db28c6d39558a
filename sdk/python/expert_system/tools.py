"""Tool calling in the SDK (docs/api.md#tool-calling), in OpenAI's shapes: `tools=[{"type":
"function", "function": {"name", "description", "parameters"}}]`, `tool_choice="none" | "auto" |
"required" | {"type": "function", "function": {"name": ...}}` (or just the function's name),
`parallel_tool_calls=`, and chat messages with `name`, `tool_call_id` and `tool_calls`
(`[{"id", "type": "function", "function": {"name", "arguments"}}]`, the arguments as JSON text or
a dict). A result's choices carry `tool_calls` (ToolCall: id, name, arguments as JSON text); a
stream's chunks carry the calls' pieces as they are generated (ToolCallDelta)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._proto.expert.v1 import common_pb2

_MODES = {
    "none": common_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": common_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": common_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: its id (`call_...`), the function's name and the arguments as JSON
    text; `json.loads(call.arguments)` gives them as a dict."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call in OpenAI's shape, for an assistant message of the next turn's history."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index` (0, 1, ... in its choice) as it is generated: the call's first piece
    has its `id` and `name`, the next ones pieces of its `arguments`, which put together are the
    arguments of the result's ToolCall."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def tool_call_delta_from_proto(message: common_pb2.ToolCallDelta) -> ToolCallDelta:
    return ToolCallDelta(message.index, message.id, message.name, message.arguments)


def tool_call_from_proto(message: common_pb2.ToolCall) -> ToolCall:
    return ToolCall(message.id, message.name, message.arguments)


def tools_into(request: common_pb2.InferenceRequest, tools: Sequence[Mapping[str, Any]]) -> None:
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise TypeError(
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}"
            )
        parameters = function.get("parameters")
        request.tools.append(
            common_pb2.Tool(
                name=str(function.get("name", "")),
                description=str(function.get("description", "")),
                parameters=json.dumps(parameters) if isinstance(parameters, Mapping) else (parameters or ""),
                strict=bool(function.get("strict", False)),
            )
        )


def tool_choice_into(request: common_pb2.InferenceRequest, choice: Any) -> None:
    if isinstance(choice, str) and choice in _MODES:
        request.tool_choice.mode = _MODES[choice]
    elif isinstance(choice, str):
        request.tool_choice.function = choice
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        request.tool_choice.function = str(choice["function"].get("name", ""))
    else:
        raise TypeError(f"tool_choice: expected none, auto, required or a function, got {choice!r}")


def chat_message(index: int, message: Any) -> common_pb2.ChatMessage:
    """A chat message dict (role and content, and the tool fields) as its proto."""
    calls_only = (
        isinstance(message, Mapping) and message.get("role") == "assistant" and message.get("tool_calls")
    )
    if (
        not isinstance(message, Mapping)
        or "role" not in message
        or ("content" not in message and not calls_only)
        or not set(message) <= _MESSAGE_KEYS
    ):
        raise TypeError(
            f"messages[{index}]: expected a dict with 'role' and 'content' (and name, tool_call_id, "
            f"tool_calls), got {message!r}"
        )
    try:
        out = common_pb2.ChatMessage(
            role=message["role"],
            content=message.get("content") or "",
            name=message.get("name") or "",
            tool_call_id=message.get("tool_call_id") or "",
        )
        for call in message.get("tool_calls") or []:
            out.tool_calls.append(_call(call))
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise TypeError(f"messages[{index}]: {exc}") from None
    return out


def _call(call: Any) -> common_pb2.ToolCall:
    if isinstance(call, ToolCall):
        call = call.to_openai()
    function = call["function"]
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return common_pb2.ToolCall(
        id=call.get("id", ""), type="function", name=function["name"], arguments=arguments
    )
