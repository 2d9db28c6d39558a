"""Tools, calls and results as a chat template sees them.

A family whose template renders tools (`native`) gets OpenAI's shapes as transformers passes them:
`tools` as `[{"type": "function", "function": {"name", "description", "parameters"}}]`, an
assistant's `tool_calls` as `[{"id", "type": "function", "function": {"name", "arguments"}}]` (the
arguments as an object), a tool result as a `tool` message with its `tool_call_id`. For any other
template the conversation is rewritten into messages every template renders (the fallback,
hermes-style, docs/api.md#tool-calling): the tools listed in the system turn with the call format,
each call as a `<tool_call>` block in the assistant's text, each result as a user turn in
`<tool_response>` tags.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from libs.gen.expert.v1 import common_pb2
from libs.tools.families import ToolFamily
from libs.tools.grammar import parameters_schema

FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to answer the user. The functions are given as JSON "
    "schemas within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def template_tools(tools: Iterable[common_pb2.Tool]) -> list[dict[str, Any]]:
    """The tools in OpenAI's shape, parameters as objects (reception checked they parse)."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = parameters_schema(tool.parameters)
        out.append({"type": "function", "function": function})
    return out


def template_messages(messages: Iterable[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The messages as dicts for a chat template: `name`, `tool_call_id` and `tool_calls` where set."""
    out = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role}
        if message.content or not message.tool_calls:
            entry["content"] = message.content
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
        out.append(entry)
    return out


def conversation(
    family: ToolFamily, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` variable to render: as they are for a native template (tools
    None when there are none), rewritten by the fallback otherwise (tools always None)."""
    if family.native:
        return messages, tools or None
    return fallback_messages(messages, tools), None


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The fallback rendering: tools in the system turn, calls and results as text."""
    out = [_fallback_message(message) for message in messages]
    if not tools:
        return out
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    instructions = FALLBACK_INSTRUCTIONS.format(tools=listing)
    if out and out[0]["role"] == "system":
        system = _text(out[0].get("content", ""))
        out[0] = {**out[0], "content": f"{system}\n\n{instructions}" if system else instructions}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def call_block(name: str, arguments: Any) -> str:
    """One call in the hermes format."""
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def _fallback_message(message: Mapping[str, Any]) -> dict[str, Any]:
    role = message["role"]
    if role == "tool":
        result = _text(message.get("content", ""))
        return {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}
    if role == "assistant" and message.get("tool_calls"):
        blocks = [
            call_block(call["function"]["name"], call["function"]["arguments"])
            for call in message["tool_calls"]
        ]
        text = _text(message.get("content", ""))
        return {"role": "assistant", "content": "\n".join([text, *blocks] if text else blocks)}
    return {key: value for key, value in message.items() if key != "tool_call_id"}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def _arguments(text: str) -> Any:
    """A call's arguments as an object, as templates expect them; kept as text if they do not parse."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text
