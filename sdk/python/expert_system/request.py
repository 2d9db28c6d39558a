"""Keyword arguments -> `InferenceRequest`: the fields a caller sets, and only those.

The proto's optional fields keep their presence: a keyword left out (or passed as None) stays
unset, so the router decides it; a keyword passed as 0 or "" is sent as that value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from ._proto.expert.v1 import common_pb2


class ChatMessageDict(TypedDict):
    role: str
    content: str


class RequestFields(TypedDict, total=False):
    """Every field of `InferenceRequest` except `prompt`, as keyword arguments of the client calls."""

    template: str
    body: str
    temperature: float
    max_tokens: int
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    force_experts: Sequence[str]
    exclude_experts: Sequence[str]
    max_experts: int
    context_size: int
    user_id: str
    priority: int
    timeout_ms: int
    stop: Sequence[str]
    seed: int
    presence_penalty: float
    frequency_penalty: float
    messages: Sequence[ChatMessageDict]
    raw: bool
    # A JSON schema as text, or as a dict that is serialised for you.
    json_schema: str | Mapping[str, Any]
    # The base model to answer with (as the fleet names it); unset: the fleet's default model.
    model: str
    # Choices to generate (1-16); the result's `choices` holds them all.
    n: int
    # Each generated token's logprob plus this many most likely alternatives (0-20).
    logprobs: int


FIELD_NAMES = frozenset(RequestFields.__annotations__)
_REPEATED_STRINGS = frozenset({"force_experts", "exclude_experts", "stop"})


def build_request(caller: str, prompt: str, fields: Mapping[str, Any]) -> common_pb2.InferenceRequest:
    """The request for `caller(prompt, **fields)`. An unknown keyword raises TypeError naming it;
    a value of the wrong type or range raises TypeError or ValueError naming the field."""
    for name in fields:
        if name not in FIELD_NAMES:
            raise TypeError(f"{caller}() got an unexpected keyword argument '{name}'")
    request = common_pb2.InferenceRequest()
    _set(request, "prompt", prompt)
    for name, value in fields.items():
        if value is None:
            continue
        if name == "messages":
            request.messages.extend(_chat_message(i, m) for i, m in enumerate(value))
        elif name in _REPEATED_STRINGS:
            # A lone string is one item, not a sequence of characters.
            items = [value] if isinstance(value, str) else list(value)
            _set_repeated(request, name, items)
        elif name == "json_schema" and isinstance(value, Mapping):
            request.json_schema = json.dumps(value)
        else:
            _set(request, name, value)
    return request


def _set(request: common_pb2.InferenceRequest, name: str, value: Any) -> None:
    try:
        setattr(request, name, value)
    except (TypeError, ValueError) as exc:  # protobuf's messages do not say which field
        raise type(exc)(f"{name}: {exc}") from None


def _set_repeated(request: common_pb2.InferenceRequest, name: str, items: list[Any]) -> None:
    try:
        getattr(request, name).extend(items)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _chat_message(index: int, message: Any) -> common_pb2.ChatMessage:
    if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
        raise TypeError(f"messages[{index}]: expected a dict with 'role' and 'content', got {message!r}")
    try:
        return common_pb2.ChatMessage(role=message["role"], content=message["content"])
    except TypeError as exc:
        raise TypeError(f"messages[{index}]: {exc}") from None
