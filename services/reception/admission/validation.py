"""The validation rules (docs/design.md#validation-rules): the original ones, the bounds of every
other field, and normalization.

Every problem is reported, each naming its field as the proto does ("request.temperature"), so one
INVALID_ARGUMENT lists all that is wrong with a request.
"""

from __future__ import annotations

import json
import re
import unicodedata

import jsonschema
import referencing
import referencing.exceptions
from referencing.jsonschema import DRAFT202012

from libs.errors import invalid_arguments
from libs.gen.expert.v1 import common_pb2
from libs.limits import API_BOUNDS, MAX_EXPERTS, sampling_problems
from libs.prompt_template import DEFAULT_BODY_TEMPLATE, rendered_length
from libs.response_format import from_request, to_structured
from libs.structured_output import MAX_FORMAT_BYTES, format_problem
from libs.utf8 import undecodable
from services.reception.admission.beams import beam_problems
from services.reception.admission.tools import tool_problems

# Bounds of what one request may hold (docs/design.md#input-limits): each keeps a request's cost
# in memory and time proportional to what a legitimate request needs.
MAX_PROMPT_CHARS = 500_000  # ~100k tokens
MAX_BODY_CHARS = MAX_PROMPT_CHARS
MAX_TEMPLATE_CHARS = 50_000
MAX_INPUT_CHARS = MAX_PROMPT_CHARS  # the rendered prompt plus every chat message, before the router
MAX_MESSAGES = 1_000
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1_000  # per stop string
MAX_NAME_CHARS = 256  # an expert name or a user id
MAX_EXCLUDED_EXPERTS = 100
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects and arrays in the schema text
MAX_FORMAT_NAME_CHARS = 64  # OpenAI's bound on response_format.json_schema.name
MAX_FORMAT_DESCRIPTION_CHARS = 1_000  # kept with the request, never shown to the model
ROLES = ("system", "user", "assistant", "tool")
TEXT_FIELDS = ("prompt", "template", "body", "user_id", "json_schema")
_ALWAYS_PRESENT = ("prompt", "user_id")  # plain proto3 fields: no presence to test
_FORMAT_NAME = re.compile(rf"[a-zA-Z0-9_-]{{1,{MAX_FORMAT_NAME_CHARS}}}")
# The original rules keep the words the API has always used for them (libs.limits has their bounds).
_TEMPERATURE, _MAX_TOKENS = API_BOUNDS["temperature"], API_BOUNDS["max_tokens"]
_ORIGINAL_WORDS = {
    "temperature": f"Temperature must be in [{_TEMPERATURE.low:.1f}, {_TEMPERATURE.high:.1f}]",
    "max_tokens": f"max_tokens must be in [{_MAX_TOKENS.low}, {_MAX_TOKENS.high}]",
}


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
    return problems + _normalize_format(request.response_format)


def _normalize_format(response_format: common_pb2.ResponseFormat) -> list[tuple[str, str]]:
    """The format's texts, normalized as the request's others are (a schema like the json_schema
    shorthand, a regex or a grammar like a stop string)."""
    kind = response_format.WhichOneof("format")
    if kind == "json_schema":
        owner, names = response_format.json_schema, ("name", "schema", "description")
    elif kind in ("regex", "grammar"):
        owner, names = response_format, (kind,)
    else:
        return []
    problems = []
    for name in names:
        value = getattr(owner, name)
        if "\x00" in value:
            field = f"request.response_format.{kind}" + (f".{name}" if owner is not response_format else "")
            problems.append((field, "must not contain NUL bytes"))
        else:
            setattr(owner, name, unicodedata.normalize("NFC", value))
    return problems


def validate(request: common_pb2.InferenceRequest, max_model_len: int = 0) -> None:
    """Normalize the request in place, then raise INVALID_ARGUMENT listing every field that is wrong.

    max_model_len is the fleet's context window (0 when no engine is known yet: the engine checks then).
    """
    problems = normalize(request)
    if not request.prompt and not request.messages and not request.prompt_token_ids:
        problems.append(("request.prompt", "Prompt cannot be empty"))
    problems += _token_ids(request, max_model_len)
    if len(request.prompt) > MAX_PROMPT_CHARS:
        problems.append(
            ("request.prompt", f"Prompt too long ({len(request.prompt)} > {MAX_PROMPT_CHARS} characters)")
        )
    problems += _sampling(request)
    problems += beam_problems(request)
    if request.HasField("max_experts") and not 1 <= request.max_experts <= MAX_EXPERTS:
        problems.append(("request.max_experts", f"max_experts must be in [1, {MAX_EXPERTS}]"))
    if request.HasField("priority") and not 0 <= request.priority <= 9:
        problems.append(("request.priority", f"must be in [0, 9], got {request.priority}"))
    if request.HasField("timeout_ms") and request.timeout_ms <= 0:
        problems.append(("request.timeout_ms", f"must be > 0, got {request.timeout_ms}"))
    if request.HasField("context_size") and request.context_size < 1:
        problems.append(("request.context_size", f"must be >= 1, got {request.context_size}"))
    problems += _stops(request)
    if len(request.user_id) > MAX_NAME_CHARS:
        problems.append(
            ("request.user_id", f"at most {MAX_NAME_CHARS} characters, got {len(request.user_id)}")
        )
    problems += _expert_lists(request)
    problems += _messages(request)
    problems += _input_size(request)
    problems += _limits(request, max_model_len)
    problems += _format(request)
    problems += tool_problems(request, _schema)
    if problems:
        raise invalid_arguments(problems)


def _token_ids(request: common_pb2.InferenceRequest, max_model_len: int) -> list[tuple[str, str]]:
    """A prompt given as token ids: alone (no text to render with it), each id a vocabulary index,
    as many as the context holds. Whether each id is below the vocabulary's size is the engine's
    check (it names `prompt_token_ids[i]` too): the fleet's capacity does not carry it."""
    ids = request.prompt_token_ids
    if not ids:
        return []
    given = {
        "prompt": bool(request.prompt),
        "messages": bool(request.messages),
        "template": request.HasField("template"),
        "body": request.HasField("body"),
    }
    problems = [
        (f"request.{name}", "not with a prompt given as token ids (prompt_token_ids)")
        for name, present in given.items()
        if present
    ]
    negative = next((i for i, token in enumerate(ids) if token < 0), None)
    if negative is not None:
        problems.append((f"request.prompt_token_ids[{negative}]", f"must be >= 0, got {ids[negative]}"))
    limit = min(max_model_len or MAX_PROMPT_CHARS, MAX_PROMPT_CHARS)
    if len(ids) >= limit:
        problems.append(
            ("request.prompt_token_ids", f"{len(ids)} tokens leave no room in the {limit}-token context")
        )
    return problems


def _sampling(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    """The sampling values the request sets, against the public API's bounds (libs.limits)."""
    values = {name: getattr(request, name) for name in API_BOUNDS if request.HasField(name)}
    return [
        (f"request.{name}", _ORIGINAL_WORDS.get(name, problem)) for name, problem in sampling_problems(values)
    ]


def _stops(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    problems = []
    if len(request.stop) > MAX_STOP_STRINGS:
        problems.append(("request.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}"))
    for i, stop in enumerate(request.stop):
        if not stop:
            problems.append((f"request.stop[{i}]", "must not be empty"))
        elif len(stop) > MAX_STOP_CHARS:
            problems.append((f"request.stop[{i}]", f"at most {MAX_STOP_CHARS} characters, got {len(stop)}"))
    return problems


def _expert_lists(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    problems = []
    for name in ("force_experts", "exclude_experts"):
        for i, value in enumerate(getattr(request, name)):
            if not value.strip():
                problems.append((f"request.{name}[{i}]", "must not be empty"))
            elif len(value) > MAX_NAME_CHARS:
                problems.append(
                    (f"request.{name}[{i}]", f"at most {MAX_NAME_CHARS} characters, got {len(value)}")
                )
    if len(request.force_experts) > MAX_EXPERTS:
        problems.append(
            ("request.force_experts", f"at most {MAX_EXPERTS} experts, got {len(request.force_experts)}")
        )
    if len(request.exclude_experts) > MAX_EXCLUDED_EXPERTS:
        problems.append(
            (
                "request.exclude_experts",
                f"at most {MAX_EXCLUDED_EXPERTS} experts, got {len(request.exclude_experts)}",
            )
        )
    both = set(request.force_experts) & set(request.exclude_experts)
    if both:
        problems.append(("request.exclude_experts", f"{sorted(both)[0]!r} is also in force_experts"))
    return problems


def _messages(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    problems = []
    if len(request.messages) > MAX_MESSAGES:
        problems.append(("request.messages", f"at most {MAX_MESSAGES} messages, got {len(request.messages)}"))
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            problems.append(
                (f"request.messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}")
            )
    if request.raw and request.messages:
        problems.append(("request.raw", "a raw completion cannot carry chat messages"))
    return problems


def _input_size(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    """The template, the body, and the input the router will render from them and the messages. A
    template can repeat a prompt that passed its own limit, so the expansion is measured (without
    rendering it) and blamed on the field that makes it: the template, the body or the messages."""
    body = request.body if request.HasField("body") else ""
    if len(body) > MAX_BODY_CHARS:
        return [("request.body", f"at most {MAX_BODY_CHARS} characters, got {len(body)}")]
    if request.HasField("template") and len(request.template) > MAX_TEMPLATE_CHARS:
        return [("request.template", f"at most {MAX_TEMPLATE_CHARS} characters, got {len(request.template)}")]
    if len(request.prompt) > MAX_PROMPT_CHARS:
        return []  # already reported as the prompt's own rule
    if request.HasField("template"):
        template, field = request.template, "request.template"
    elif body:
        template, field = DEFAULT_BODY_TEMPLATE, "request.body"
    else:
        template, field = "{prompt}", "request.messages"
    total = rendered_length(template, request.prompt, body) + sum(len(m.content) for m in request.messages)
    if total <= MAX_INPUT_CHARS:
        return []
    return [
        (
            field,
            f"the input rendered from the prompt, template, body and messages would be {total} characters,"
            f" above the limit of {MAX_INPUT_CHARS}",
        )
    ]


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


def format_field(kind: str, shorthand: bool = False) -> str:
    """The field that holds the text of a format of this kind, as violations name it."""
    if shorthand:
        return "request.json_schema"
    if kind == "json_schema":
        return "request.response_format.json_schema.schema"
    if kind in ("regex", "grammar"):
        return f"request.response_format.{kind}"
    return "request.response_format"  # json_object has no text


def _format(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    """The output format (docs/api.md#structured-output): json_schema or response_format, not both;
    a schema must be a valid JSON Schema; then every kind must be one the engine can enforce
    (libs.structured_output refuses what llguidance cannot: a keyword it does not implement is
    refused here rather than ignored when the engine samples)."""
    shorthand = request.HasField("json_schema")
    if shorthand and request.HasField("response_format"):
        return [("request.json_schema", "set either json_schema or response_format")]
    if request.HasField("response_format") and request.response_format.WhichOneof("format") is None:
        return [("request.response_format", "set one of json_object, json_schema, regex or grammar")]
    response_format = from_request(request)
    if response_format is None:
        return []
    kind = response_format.WhichOneof("format")
    if kind == "json_schema":
        problems = _schema_details(response_format.json_schema)
        schema_problems = _schema(response_format.json_schema.schema, format_field(kind, shorthand))
        if schema_problems:  # llguidance's check would only repeat them
            return problems + schema_problems
    else:
        problems = []
    problem = format_problem(to_structured(response_format))
    if problem is not None:
        problems.append((format_field(kind, shorthand), problem))
    return problems


def _schema_details(spec: common_pb2.JsonSchemaFormat) -> list[tuple[str, str]]:
    """A json_schema format's name (optional on gRPC; OpenAI's bound when set) and description."""
    problems = []
    if spec.name and not _FORMAT_NAME.fullmatch(spec.name):
        problems.append(
            (
                "request.response_format.json_schema.name",
                f"at most {MAX_FORMAT_NAME_CHARS} of a-z, A-Z, 0-9, _ and -, got {spec.name[:80]!r}",
            )
        )
    if len(spec.description) > MAX_FORMAT_DESCRIPTION_CHARS:
        problems.append(
            (
                "request.response_format.json_schema.description",
                f"at most {MAX_FORMAT_DESCRIPTION_CHARS} characters, got {len(spec.description)}",
            )
        )
    return problems


def _schema(text: str, field: str) -> list[tuple[str, str]]:
    size = len(text.encode())
    if size > MAX_FORMAT_BYTES:
        return [(field, f"at most {MAX_FORMAT_BYTES} bytes, got {size}")]
    depth = json_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        return [(field, f"nested {depth} levels deep, above the limit of {MAX_SCHEMA_DEPTH}")]
    try:
        schema = json.loads(text)
        jsonschema.Draft202012Validator.check_schema(schema)
    except (json.JSONDecodeError, jsonschema.SchemaError) as exc:
        return [(field, f"not a valid JSON schema: {str(exc).splitlines()[0]}")]
    found = undecodable(schema, "")
    if found is not None:  # escaped in the text: the engine decodes it into a grammar or a prompt
        return [(field, f"{found[1]} (decoded, at {found[0] or 'a key'})")]
    unresolved = _unresolved_reference(schema)
    if unresolved is not None:
        return [(field, f"$ref {unresolved!r} does not resolve within the schema")]
    return []


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text, found in one pass without parsing (so
    a hostile depth never reaches a recursive parser). Brackets inside strings do not count."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _unresolved_reference(schema: object) -> str | None:
    """The first `$ref` that does not point into the schema itself; None when all do. Nothing is
    fetched, so a remote or dangling reference would fail every output check later."""
    resource = DRAFT202012.create_resource(schema)
    base = resource.id() or ""
    resolver = referencing.Registry().with_resource(base, resource).resolver(base_uri=base)
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                try:
                    resolver.lookup(ref)
                except referencing.exceptions.Unresolvable:
                    return ref
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return None
