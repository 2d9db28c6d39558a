"""Keyword arguments -> `InferenceRequest`: the fields a caller sets, and only those.

The proto's optional fields keep their presence: a keyword left out (or passed as None) stays
unset, so the router decides it; a keyword passed as 0 or "" is sent as that value. The output's
format is given in OpenAI's shape (`response_format={"type": "json_schema", ...}`), or as
`regex=` or `grammar=` (docs/api.md#structured-output).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from google.protobuf.message import Message

from ._proto.expert.v1 import common_pb2
from .tools import chat_message, tool_choice_into, tools_into


class ChatMessageDict(TypedDict, total=False):
    role: str
    content: str
    # OpenAI's tool fields: the participant's name, the call a tool result answers, an assistant's calls.
    name: str
    tool_call_id: str
    tool_calls: Sequence[Mapping[str, Any]]


class RequestFields(TypedDict, total=False):
    """Every field of `InferenceRequest` except `prompt`, as keyword arguments of the client calls,
    and `regex` and `grammar`, shorthands for a `response_format` of that kind."""

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
    # The output's format, in OpenAI's shape: {"type": "json_object"}, {"type": "json_schema",
    # "json_schema": {"name", "schema", "strict", "description"}} (the schema a dict or JSON text),
    # {"type": "regex", "regex": ...}, {"type": "grammar", "grammar": ...}; {"type": "text"}: none.
    response_format: Mapping[str, Any]
    # The prompt as token ids of the model's vocabulary, completed as they are (pass prompt="").
    prompt_token_ids: Sequence[int]
    # vLLM's: generate past the end-of-sequence token.
    ignore_eos: bool
    # vLLM's: False writes special tokens into the text (unset: they are left out).
    skip_special_tokens: bool
    # Speculative decoding on (True) or off (False) for this request; unset: the engine's setting.
    speculative: bool
    # Generate this many sequences (n-16) and return the n with the highest cumulative logprob;
    # with use_beam_search, the number of beams.
    best_of: int
    # Beam search with best_of (else n) beams, returning the n best (temperature 0, no sampling
    # settings, stop strings, logprobs or formats with it).
    use_beam_search: bool
    # Beam search: score = logprob / length ** length_penalty (unset: 1), as transformers.
    length_penalty: float
    # Beam search: True, False or "never", as transformers' generate (unset: False).
    early_stopping: bool | str
    # A regex the whole output matches: response_format={"type": "regex", "regex": ...}.
    regex: str
    # A grammar in llguidance's Lark dialect: response_format={"type": "grammar", "grammar": ...}.
    grammar: str
    # Functions the model may call, in OpenAI's shape (expert_system.tools).
    tools: Sequence[Mapping[str, Any]]
    # "none", "auto" (the default with tools), "required", or a function (its name, or OpenAI's dict).
    tool_choice: str | Mapping[str, Any]
    # False: at most one call per answer.
    parallel_tool_calls: bool


FIELD_NAMES = frozenset(RequestFields.__annotations__)
_REPEATED_STRINGS = frozenset({"force_experts", "exclude_experts", "stop"})
# The keywords that each set the request's response_format: one of them at most.
_FORMAT_KEYWORDS = ("response_format", "regex", "grammar")
_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def build_request(caller: str, prompt: str, fields: Mapping[str, Any]) -> common_pb2.InferenceRequest:
    """The request for `caller(prompt, **fields)`. An unknown keyword raises TypeError naming it;
    a value of the wrong type or range raises TypeError or ValueError naming the field."""
    for name in fields:
        if name not in FIELD_NAMES:
            raise TypeError(f"{caller}() got an unexpected keyword argument '{name}'")
    formats = [name for name in _FORMAT_KEYWORDS if fields.get(name) is not None]
    if len(formats) > 1:
        raise ValueError(
            f"{formats[1]}: give one of response_format, regex and grammar, not {formats[0]} too"
        )
    request = common_pb2.InferenceRequest()
    _set(request, "prompt", prompt)
    for name, value in fields.items():
        if value is not None:
            _set_field(request, name, value)
    return request


def _set_field(request: common_pb2.InferenceRequest, name: str, value: Any) -> None:
    """One keyword's value into the request, in the field's own shape."""
    if name == "messages":
        request.messages.extend(chat_message(i, m) for i, m in enumerate(value))
    elif name == "tools":
        tools_into(request, value)
    elif name == "tool_choice":
        tool_choice_into(request, value)
    elif name == "prompt_token_ids":
        _set_repeated(request, name, list(value))
    elif name in _REPEATED_STRINGS:
        # A lone string is one item, not a sequence of characters.
        items = [value] if isinstance(value, str) else list(value)
        _set_repeated(request, name, items)
    elif name == "json_schema" and isinstance(value, Mapping):
        request.json_schema = json.dumps(value)
    elif name == "response_format":
        _response_format(request, value)
    elif name in ("regex", "grammar"):
        _set(request.response_format, name, value)
    elif name == "early_stopping" and isinstance(value, bool):
        request.early_stopping = "true" if value else "false"  # the proto holds it as text
    else:
        _set(request, name, value)


def _response_format(request: common_pb2.InferenceRequest, value: Any) -> None:
    """`response_format` in OpenAI's shape (plus the regex and grammar types) into the request."""
    if not isinstance(value, Mapping):
        raise TypeError(f"response_format: expected a dict with 'type', got {value!r}")
    kind = value.get("type")
    if kind not in _FORMAT_TYPES:
        raise ValueError(f"response_format.type: must be one of {', '.join(_FORMAT_TYPES)}, got {kind!r}")
    allowed = {"type"} if kind in ("text", "json_object") else {"type", kind}
    for key in value:
        if key not in allowed:
            raise ValueError(f"response_format.{key}: not an argument of type {kind!r}")
    if kind == "text":
        return  # free text: no format
    if kind == "json_object":
        request.response_format.json_object.SetInParent()
    elif kind == "json_schema":
        _json_schema_format(request.response_format.json_schema, value.get("json_schema"))
    else:
        if kind not in value:
            raise ValueError(f"response_format.{kind}: required with type {kind!r}")
        _set(request.response_format, kind, value[kind], f"response_format.{kind}")


def _json_schema_format(spec: common_pb2.JsonSchemaFormat, value: Any) -> None:
    field = "response_format.json_schema"
    if not isinstance(value, Mapping):
        raise TypeError(f"{field}: expected a dict with 'schema', got {value!r}")
    for key in value:
        if key not in _JSON_SCHEMA_KEYS:
            raise ValueError(f"{field}.{key}: not an argument (expected name, schema, strict, description)")
    if "schema" not in value:
        raise ValueError(f"{field}.schema: required")
    schema = value["schema"]
    if not isinstance(schema, str | Mapping):
        raise TypeError(f"{field}.schema: expected a dict or JSON text, got {type(schema).__name__}")
    spec.schema = schema if isinstance(schema, str) else json.dumps(schema)
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise TypeError(f"{field}.strict: expected True or False, got {value['strict']!r}")
    for key in ("name", "strict", "description"):
        if value.get(key) is not None:
            _set(spec, key, value[key], f"{field}.{key}")


def _set(message: Message, name: str, value: Any, field: str | None = None) -> None:
    """`message.name = value`; an error names `field` (default: `name`)."""
    try:
        setattr(message, name, value)
    except (TypeError, ValueError) as exc:  # protobuf's messages do not say which field
        raise type(exc)(f"{field or name}: {exc}") from None


def _set_repeated(request: common_pb2.InferenceRequest, name: str, items: list[Any]) -> None:
    try:
        getattr(request, name).extend(items)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


# A chat message dict as its proto (sessions' messages too).
_chat_message = chat_message
