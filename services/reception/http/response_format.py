"""`response_format` over HTTP (docs/api.md#structured-output): OpenAI's shape (`text`,
`json_object`, `json_schema`) plus the `regex` and `grammar` types vLLM and SGLang offer as
extensions, into the request's ResponseFormat. A bad shape is a 400 naming the exact part
(`response_format.json_schema.schema`); whether the format can be enforced is reception's
validation, whose violations name the same parts (errors.param_of).

The OpenAI endpoints follow OpenAI: `json_schema.name` is required and the schema is an object. The
REST API is the Expert System's own: there the name may be left out, as on gRPC, and the schema may
also be JSON text, as its `json_schema` field is.
"""

from __future__ import annotations

import json
from typing import Any

from libs.gen.expert.v1 import common_pb2
from services.reception.http.body_text import first_undecodable
from services.reception.http.errors import HttpError

TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _bad(param: str, message: str, code: str = "invalid_value") -> HttpError:
    return HttpError(400, f"{param} {message}", param, code)


def parse_response_format(value: dict[str, Any], *, openai: bool) -> common_pb2.ResponseFormat | None:
    """The format `value` asks for; None for `{"type": "text"}` (free text)."""
    undecodable = first_undecodable(value, "response_format")
    if undecodable is not None:  # named by its part: `response_format.json_schema.schema`
        parts = undecodable.split(".")
        part = ".".join(parts[:3] if parts[1:2] == ["json_schema"] else parts[:2])
        raise _bad(part, "is not valid Unicode text: it holds a lone surrogate")
    kind = value.get("type")
    if kind not in TYPES:
        raise _bad("response_format.type", f"must be one of {', '.join(TYPES)}, got {kind!r}")
    allowed = {"type"} if kind in ("text", "json_object") else {"type", kind}
    for key in sorted(set(value) - allowed):
        raise _bad(f"response_format.{key}", f"is not an argument of type {kind}", "unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())
    if kind == "json_schema":
        return common_pb2.ResponseFormat(json_schema=_json_schema(value.get("json_schema"), openai=openai))
    text = value.get(kind)
    if not isinstance(text, str):
        raise _bad(f"response_format.{kind}", f"must be a string (the {kind})")
    return common_pb2.ResponseFormat(**{kind: text})


def _json_schema(spec: Any, *, openai: bool) -> common_pb2.JsonSchemaFormat:
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object with name and schema")
    for key in sorted(set(spec) - _JSON_SCHEMA_KEYS):
        raise _bad(f"response_format.json_schema.{key}", "is not an argument", "unknown_parameter")
    name = spec.get("name")
    if (openai or name is not None) and (not isinstance(name, str) or not name):
        raise _bad("response_format.json_schema.name", "must be a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad("response_format.json_schema.strict", "must be true or false")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _bad("response_format.json_schema.description", "must be a string")
    schema = spec.get("schema")
    if isinstance(schema, dict):
        schema_text = json.dumps(schema)
    elif isinstance(schema, str) and not openai:
        schema_text = schema
    else:
        what = "a JSON Schema object" if openai else "a JSON Schema object, or its JSON text"
        raise _bad("response_format.json_schema.schema", f"must be {what}")
    return common_pb2.JsonSchemaFormat(
        name=name or "",
        schema=schema_text,
        strict=bool(spec.get("strict")),
        description=spec.get("description") or "",
    )
