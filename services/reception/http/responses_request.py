"""A Responses API request as the chat-completions request that answers it: the same model, sampling
and limits, `instructions` as the first (system) message, the stored conversation of
`previous_response_id` and then `input` as the messages, `text.format` as `response_format`, the
flat function tools as chat's `tools`. Errors the chat path raises name chat's fields; `in_responses_terms`
renames them to the fields the client sent (`max_tokens` -> `max_output_tokens`)."""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from services.reception.http.errors import HttpError, not_supported, validation_error
from services.reception.http.openai_schema import ChatCompletionRequest
from services.reception.http.responses_input import input_messages
from services.reception.http.responses_schema import ResponsesRequest

TOOL_CHOICES = ("none", "auto", "required")
# Values of `include` that ask for nothing we could leave out: we produce no reasoning.
_HARMLESS_INCLUDES = {"reasoning.encrypted_content"}
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise not_supported("background", "background (asynchronous responses)")
    if body.conversation is not None:
        raise not_supported("conversation", "conversation (the Conversations API; use previous_response_id)")
    if body.prompt is not None:
        raise not_supported("prompt", "prompt (stored prompt templates)")
    if body.max_tool_calls is not None:
        raise not_supported("max_tool_calls", "max_tool_calls")
    if body.top_logprobs:
        raise not_supported("top_logprobs", "top_logprobs")
    for i, name in enumerate(body.include or []):
        if name not in _HARMLESS_INCLUDES:
            raise not_supported(f"include[{i}]", f"include {name!r}")


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list]:
    """The chat request for `body` continuing the conversation `history` (chat messages), and the
    messages `input` added (the conversation to store is history, those, then the answer)."""
    _refuse_unsupported(body)
    added = input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": [*system, *history, *added],
        "stream": body.stream,
    }
    if body.stream:  # the usage comes in the last chunk, for response.completed
        chat["stream_options"] = {"include_usage": True}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("user", "user")):  # fmt: skip
        if getattr(body, ours) is not None:
            chat[theirs] = getattr(body, ours)
    if body.tools:
        chat["tools"] = [_tool(tool, i) for i, tool in enumerate(body.tools)]
        if body.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    response_format = _response_format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(chat), added
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise in_responses_terms(validation_error(RequestValidationError(errors))) from None


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """A flat Responses function tool (`{type, name, parameters, ...}`) in chat's nested shape."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        if isinstance(kind, str):
            raise not_supported(f"tools[{i}].type", f"the built-in tool {kind!r} (function tools only)")
        raise HttpError(400, f"tools[{i}].type must be 'function'", f"tools[{i}].type", "invalid_value")
    for key in sorted(set(tool) - {"type", *_FUNCTION_KEYS}):
        raise HttpError(400, f"tools[{i}].{key} is not an argument", f"tools[{i}].{key}", "unknown_parameter")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise HttpError(
            400, f"tools[{i}].name must be a non-empty string", f"tools[{i}].name", "invalid_value"
        )
    function = {key: tool[key] for key in _FUNCTION_KEYS if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        raise not_supported("tool_choice.type", f"tool_choice of type {choice['type']!r}")
    raise HttpError(
        400,
        "tool_choice must be none, auto, required or {type: function, name}",
        "tool_choice",
        "invalid_value",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: free text); `text.verbosity` is ignored."""
    if text is None:
        return None
    for key in sorted(set(text) - {"format", "verbosity"}):
        raise HttpError(400, f"text.{key} is not an argument", f"text.{key}", "unknown_parameter")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise HttpError(400, "text.format must be an object with a type", "text.format", "invalid_value")
    if spec.get("type") != "json_schema":
        return dict(spec)  # text, json_object, or a type the chat path refuses by name
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}


# Chat's name of a field -> the Responses API's (the rest are the same).
_RENAMES = (
    (r"messages(\[\d+\])?(\..*)?", "input"),
    (r"max_(completion_)?tokens", "max_output_tokens"),
    (r"response_format\.json_schema(\..*)?", r"text.format\1"),
    (r"response_format(\..*)?", r"text.format\1"),
    (r"tools(\[\d+\])\.function(\..*)?", r"tools\1\2"),
    (r"tool_choice\.function(\..*)?", r"tool_choice\1"),
)


def responses_param(param: str | None) -> str | None:
    """A chat request's field named as the Responses request that made it names it."""
    if param is None:
        return None
    for pattern, replacement in _RENAMES:
        if re.fullmatch(pattern, param):
            return re.sub(pattern, replacement, param)
    return param


def in_responses_terms(error: HttpError) -> HttpError:
    """`error` (raised by the chat path) with the field it names as the Responses API names it."""
    renamed = responses_param(error.param)
    if renamed != error.param and error.param is not None:
        error.message = error.message.replace(error.param, renamed)
        error.param = renamed
    return error


def error_body_in_responses_terms(body: dict[str, Any]) -> dict[str, Any]:
    """An error body of the chat path with its field renamed (the rest unchanged)."""
    error = body.get("error")
    if isinstance(error, dict) and error.get("param"):
        renamed = responses_param(error["param"])
        body["error"] = {
            **error,
            "param": renamed,
            "message": error["message"].replace(error["param"], renamed),
        }
    return body
