"""A Responses API `input` as chat-completions messages (OpenAI's chat shapes): a string is one user
message; a list's items are messages (their text parts joined), `function_call` items become an
assistant message's `tool_calls` (consecutive calls, and a message just before them, are one
assistant turn, as a chat completion returns them) and `function_call_output` items `tool` messages
with their `tool_call_id`. An item we cannot carry is refused, the part named (`input[1].content[0]`)."""

from __future__ import annotations

from typing import Any

from services.reception.http.errors import HttpError, not_supported

ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _bad(param: str, message: str, code: str = "invalid_value") -> HttpError:
    return HttpError(400, f"{param} {message}", param, code)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages `value` (a request's `input`) stands for."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise _bad("input", "must not be empty")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, _call(item, where))
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        elif isinstance(kind, str):  # item_reference, reasoning, the built-in tools' items
            raise not_supported(
                f"{where}.type", f"an input item of type {kind!r} (we take {', '.join(ITEM_TYPES)})"
            )
        else:
            raise _bad(f"{where}.type", f"must be one of {', '.join(ITEM_TYPES)}")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A message's content as its text: a string, or its text parts joined (images, files and
    audio are refused: the models served here read text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            if isinstance(kind, str):
                raise not_supported(f"{where}[{j}]", f"a content part of type {kind!r} (text only)")
            raise _bad(f"{where}[{j}].type", "must name the part's type (input_text)")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _bad(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _bad(
            f"{where}.{key}", "must be a non-empty string" if key != "arguments" else "must be a string"
        )
    return value


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` item as a chat `tool_calls` entry."""
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
    }


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A call joins the assistant turn just before it (its text, or its other calls), else starts one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        if not last.get("content"):
            last["content"] = None
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, f"{where}.output")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text}
