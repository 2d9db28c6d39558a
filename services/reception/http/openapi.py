"""The OpenAPI document reception serves at /openapi.json, as vLLM does: FastAPI's, generated from the
routes' pydantic request models (openai_schema.py, responses_schema.py, rest_schema.py), completed
here for the routes that read their input themselves (a multipart upload, a query read by hand, a
body checked field by field), so that it describes every route a client, or the fuzzer of
tests/e2e/test_http_fuzz.py, may call. Every refusal is documented as OpenAI's error body, which
is what reception answers (never FastAPI's 422)."""

from __future__ import annotations

import re
import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.reception.admission.validation import ROLES
from services.reception.http.files import FILES_PATH
from services.reception.http.fine_tuning_request import HYPERPARAMETERS, KNOWN

OPENAPI_PATH = "/openapi.json"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}
REFUSED = {"description": "refused", "content": {"application/json": {"schema": ERROR_REF}}}
_TEXT = {"type": "string"}
_INTEGER = {"type": "integer"}
_NUMBER = {"type": "number"}
_OBJECT = {"type": "object"}
_NULLABLE_TEXT = {"type": ["string", "null"]}

# POST /v1/files: the multipart form files.py reads (`file` and `purpose`).
_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {"file": {"type": "string", "format": "binary"}, "purpose": _TEXT},
            }
        }
    },
}
# GET /v1/files: the query files.py's ListQuery reads.
_FILES_QUERY = [
    {"name": "after", "in": "query", "required": False, "schema": _TEXT},
    {"name": "limit", "in": "query", "required": False, "schema": _INTEGER},
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
    {"name": "purpose", "in": "query", "required": False, "schema": _TEXT},
]
# The JSON type of each field OpenAI's fine-tuning request has; fine_tuning_request.py owns which
# fields are known and what each may hold.
_FINE_TUNING_TYPES: dict[str, dict[str, Any]] = {
    "model": _TEXT,
    "training_file": _TEXT,
    "validation_file": _NULLABLE_TEXT,
    "suffix": _NULLABLE_TEXT,
    "seed": {"type": ["integer", "null"]},
    "method": _OBJECT,
    "integrations": {"type": ["array", "null"]},
    "metadata": {"type": ["object", "null"]},
}
_HYPERPARAMETER = {"anyOf": [{"type": "string", "enum": ["auto"]}, _NUMBER]}
# The training job spec of docs/api.md#training-jobs, its sections as objects: libs/training/spec.py
# owns their fields and bounds, and names every field it refuses.
_TRAINING_SPEC = {
    "type": "object",
    "required": ["training_file", "expert"],
    "properties": {
        "base_model": _TEXT,
        "training_file": _TEXT,
        "validation_file": _TEXT,
        "adapter": _OBJECT,
        "hyperparameters": _OBJECT,
        "checkpoint_every_steps": _INTEGER,
        "time_budget_seconds": _INTEGER,
        "expert": {"type": "object", "required": ["name"], "properties": {"name": _TEXT, "version": _TEXT}},
    },
}

# The parts the request models take free-form and check part by part (openai_tools.py,
# response_format.py, responses_input.py), described as OpenAI documents them, so that a client
# sees their shape and the fuzzer reaches the checks behind them.
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _TEXT, "description": _TEXT, "parameters": _OBJECT, "strict": {"type": "boolean"}},
}
_CALL = {
    "type": "object",
    "required": ["name", "arguments"],
    "properties": {"name": _TEXT, "arguments": _TEXT},
}
_SHAPES: dict[str, dict[str, Any]] = {
    "FunctionTool": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION},
    },
    "Function": _FUNCTION,
    "FunctionCall": _CALL,
    "ToolCall": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {"id": _TEXT, "type": {"enum": ["function"]}, "function": _CALL},
    },
    "ToolChoice": {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"enum": ["function"]},
                    "function": {"type": "object", "properties": {"name": _TEXT}},
                },
            },
        ]
    },
    "ResponseFormat": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema", "regex", "grammar"]},
            "json_schema": {
                "type": "object",
                "properties": {"name": _TEXT, "schema": _OBJECT, "strict": {"type": "boolean"}},
            },
            "regex": _TEXT,
            "grammar": _TEXT,
        },
    },
    "ResponsesTool": {
        "type": "object",
        "required": ["type", "name"],
        "properties": {"type": {"enum": ["function"]}, **_FUNCTION["properties"]},
    },
    "ResponsesInputItem": {
        "type": "object",
        "properties": {
            "type": {"enum": ["message", "function_call", "function_call_output"]},
            "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": _TEXT,
            "call_id": _TEXT,
            "name": _TEXT,
            "arguments": _TEXT,
            "output": _TEXT,
        },
    },
}
# (schema, property) -> the shape it holds, `[name]` for a list of them.
_FREE_FORM = {
    ("ChatCompletionRequest", "tools"): "[FunctionTool]",
    ("ChatCompletionRequest", "functions"): "[Function]",
    ("ChatCompletionRequest", "function_call"): "FunctionCall",
    ("ChatCompletionRequest", "tool_choice"): "ToolChoice",
    ("ChatCompletionRequest", "response_format"): "ResponseFormat",
    ("CompletionRequest", "response_format"): "ResponseFormat",
    ("Message", "tool_calls"): "[ToolCall]",
    ("Message", "function_call"): "FunctionCall",
    ("JobBody", "response_format"): "ResponseFormat",
    ("InferBody", "response_format"): "ResponseFormat",
    ("ResponsesRequest", "tools"): "[ResponsesTool]",
    ("ResponsesRequest", "tool_choice"): "ToolChoice",
    ("ResponsesRequest", "input"): "[ResponsesInputItem]",
}


def _describe_free_form(schemas: dict[str, Any]) -> None:
    """Each free-form part of a request model as the shape it holds (or null, or for `input` a string)."""
    schemas.update(_SHAPES)
    for (model, name), shape in _FREE_FORM.items():
        if name not in schemas.get(model, {}).get("properties", {}):
            continue
        ref = {"$ref": "#/components/schemas/" + shape.strip("[]")}
        value = {"type": "array", "items": ref} if shape.startswith("[") else ref
        other = _TEXT if name == "input" else {"type": "null"}
        schemas[model]["properties"][name] = {"anyOf": [value, other]}
    if "Message" in schemas:
        # the roles validation.py takes, and OpenAI's names for system and tool (openai_request.py)
        schemas["Message"]["properties"]["role"] = {"enum": sorted({*ROLES, "developer", "function"})}


def serve_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (what FastAPI serves at `app.openapi_url`) this module's document."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document of `app`'s routes, completed for the routes that read their own input."""
    with warnings.catch_warnings():
        # FastAPI names a GET+HEAD route's two operations alike, and warns: they are renamed below.
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Error"] = ERROR_SCHEMA
    _describe_free_form(schemas)
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            # unique ids (a GET+HEAD route's two operations share FastAPI's)
            operation["operationId"] = _operation_id(method, path)
            operation["responses"].pop("422", None)
            operation["responses"]["4XX"] = REFUSED
    _describe_read_by_hand(doc["paths"])
    return doc


def _operation_id(method: str, path: str) -> str:
    return method + "_" + re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")


def _describe_read_by_hand(paths: dict[str, Any]) -> None:
    """The inputs of the routes that take a raw request rather than a model FastAPI describes."""
    if FILES_PATH in paths:
        paths[FILES_PATH]["post"]["requestBody"] = _UPLOAD
        paths[FILES_PATH]["get"]["parameters"] = _FILES_QUERY
    fine_tuning = paths.get("/v1/fine_tuning/jobs", {}).get("post")
    if fine_tuning is not None:
        fine_tuning["requestBody"] = _json_body(_fine_tuning_request())
    training = paths.get("/v1/training/jobs", {}).get("post")
    if training is not None:
        training["requestBody"] = _json_body(_TRAINING_SPEC)


def _fine_tuning_request() -> dict[str, Any]:
    properties = {name: _FINE_TUNING_TYPES.get(name, {}) for name in sorted(KNOWN)}
    properties["hyperparameters"] = {
        "type": "object",
        "properties": {name: _HYPERPARAMETER for name in sorted(HYPERPARAMETERS)},
    }
    return {"type": "object", "required": ["model", "training_file"], "properties": properties}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}
