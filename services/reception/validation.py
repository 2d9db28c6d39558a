"""The validation rules (docs/design.md#validation-rules): the original ones, the bounds of every
other field, and normalization.

Every problem is reported, each naming its field as the proto does ("request.temperature"), so one
INVALID_ARGUMENT lists all that is wrong with a request.
"""

from __future__ import annotations

import json
import math
import unicodedata

import jsonschema

from libs.errors import invalid_arguments
from libs.gen.expert.v1 import common_pb2

MAX_PROMPT_CHARS = 500_000  # ~100k tokens
MAX_STOP_STRINGS = 16
ROLES = ("system", "user", "assistant", "tool")
TEXT_FIELDS = ("prompt", "template", "body", "user_id", "json_schema")
_ALWAYS_PRESENT = ("prompt", "user_id")  # plain proto3 fields: no presence to test


def normalize(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    """Trim and NFC-normalize the text fields in place; NUL bytes are problems, not normalized away."""
    problems = []
    for name in TEXT_FIELDS:
        if name not in _ALWAYS_PRESENT and not request.HasField(name):
            continue
        value = getattr(request, name)
        if "\x00" in value:
            problems.append((f"request.{name}", "must not contain NUL bytes"))
            continue
        value = unicodedata.normalize("NFC", value)
        setattr(request, name, value.strip() if name in _ALWAYS_PRESENT else value)
    for i, message in enumerate(request.messages):
        if "\x00" in message.content or "\x00" in message.role:
            problems.append((f"request.messages[{i}]", "must not contain NUL bytes"))
            continue
        message.role = message.role.strip()
        message.content = unicodedata.normalize("NFC", message.content)
    for i, stop in enumerate(request.stop):
        if "\x00" in stop:
            problems.append((f"request.stop[{i}]", "must not contain NUL bytes"))
        else:
            request.stop[i] = unicodedata.normalize("NFC", stop)
    return problems


def _bound(problems, request, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    if not request.HasField(name):
        return
    value = getattr(request, name)
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        problems.append((f"request.{name}", f"must be in {interval}, got {value:g}"))


def validate(request: common_pb2.InferenceRequest, max_model_len: int = 0) -> None:
    """Normalize the request in place, then raise INVALID_ARGUMENT listing every field that is wrong.

    max_model_len is the fleet's context window (0 when no engine is known yet: the engine checks then).
    """
    problems = normalize(request)
    # the original rules
    if not request.prompt and not request.messages:
        problems.append(("request.prompt", "Prompt cannot be empty"))
    if len(request.prompt) > MAX_PROMPT_CHARS:
        problems.append(
            ("request.prompt", f"Prompt too long ({len(request.prompt)} > {MAX_PROMPT_CHARS} characters)")
        )
    if request.HasField("temperature") and not (
        math.isfinite(request.temperature) and 0.0 <= request.temperature <= 2.0
    ):
        problems.append(("request.temperature", "Temperature must be in [0.0, 2.0]"))
    if request.HasField("max_tokens") and not 1 <= request.max_tokens <= 200_000:
        problems.append(("request.max_tokens", "max_tokens must be in [1, 200000]"))
    if request.HasField("max_experts") and not 1 <= request.max_experts <= 10:
        problems.append(("request.max_experts", "max_experts must be in [1, 10]"))
    # the other fields (vLLM / OpenAI-style bounds)
    _bound(problems, request, "top_p", 0.0, 1.0, low_open=True)
    if request.HasField("top_k") and request.top_k < 0:
        problems.append(("request.top_k", f"must be >= 0 (0 = off), got {request.top_k}"))
    _bound(problems, request, "min_p", 0.0, 1.0)
    _bound(problems, request, "repetition_penalty", 1.0, 2.0)
    _bound(problems, request, "presence_penalty", -2.0, 2.0)
    _bound(problems, request, "frequency_penalty", -2.0, 2.0)
    if request.HasField("priority") and not 0 <= request.priority <= 9:
        problems.append(("request.priority", f"must be in [0, 9], got {request.priority}"))
    if request.HasField("timeout_ms") and request.timeout_ms <= 0:
        problems.append(("request.timeout_ms", f"must be > 0, got {request.timeout_ms}"))
    if request.HasField("context_size") and request.context_size < 1:
        problems.append(("request.context_size", f"must be >= 1, got {request.context_size}"))
    if len(request.stop) > MAX_STOP_STRINGS:
        problems.append(("request.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}"))
    problems += [(f"request.stop[{i}]", "must not be empty") for i, s in enumerate(request.stop) if not s]
    problems += _expert_lists(request)
    problems += _messages(request)
    problems += _limits(request, max_model_len)
    if request.HasField("json_schema"):
        problems += _schema(request.json_schema)
    if problems:
        raise invalid_arguments(problems)


def _expert_lists(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    problems = []
    for name in ("force_experts", "exclude_experts"):
        for i, value in enumerate(getattr(request, name)):
            if not value.strip():
                problems.append((f"request.{name}[{i}]", "must not be empty"))
    if len(request.force_experts) > 10:
        problems.append(("request.force_experts", f"at most 10 experts, got {len(request.force_experts)}"))
    both = set(request.force_experts) & set(request.exclude_experts)
    if both:
        problems.append(("request.exclude_experts", f"{sorted(both)[0]!r} is also in force_experts"))
    return problems


def _messages(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    problems = []
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            problems.append(
                (f"request.messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}")
            )
    if request.raw and request.messages:
        problems.append(("request.raw", "a raw completion cannot carry chat messages"))
    return problems


def _limits(request: common_pb2.InferenceRequest, max_model_len: int) -> list[tuple[str, str]]:
    problems = []
    window = max_model_len or None
    if request.HasField("context_size") and window and request.context_size > window:
        problems.append(
            (
                "request.context_size",
                f"the model's context window is {window} tokens, got {request.context_size}",
            )
        )
    if request.HasField("context_size") and request.context_size >= 1:
        window = min(window or request.context_size, request.context_size)
    if request.HasField("max_tokens") and window and request.max_tokens >= window:
        problems.append(
            (
                "request.max_tokens",
                f"must leave room for the prompt within the {window}-token context, got {request.max_tokens}",
            )
        )
    return problems


def _schema(text: str) -> list[tuple[str, str]]:
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(text))
    except (json.JSONDecodeError, jsonschema.SchemaError) as exc:
        return [("request.json_schema", f"not a valid JSON schema: {str(exc).splitlines()[0]}")]
    return []
