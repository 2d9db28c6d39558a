"""Reception's HTTP front in process: text no UTF-8 can carry (a lone surrogate, which JSON may
escape) is refused in every field of every JSON body, 400 in OpenAI's shape naming the field as the
client wrote it, before anything is admitted (services/reception/http/text_guard.py); and a flag
is a JSON boolean, never a word read as true."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from services.reception.http import create_app
from tests.unit.test_http_api import FakeAdmission, FakeCapacity, FakeModels

S = "\ud800"  # a lone surrogate: json.dumps writes it as the escape "\\ud800", as JSON allows
USER = {"role": "user", "content": "hi"}


def _chat(*messages, **fields) -> dict:
    return {"model": "base", "messages": [*messages, USER], **fields}


def _call(name: str = "f", arguments: str = "{}") -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(name: str = "f", description: str = "d", parameters: dict | None = None) -> dict:
    function = {"name": name, "description": description, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function}


def _assistant(**fields) -> dict:
    return {"role": "assistant", "content": None, **fields}


# (route, body, the field to be named); each body is sent as json.dumps writes it
CASES = {
    "chat call arguments": (
        "/v1/chat/completions",
        _chat(_assistant(tool_calls=[_call(arguments='{"a": "' + S + '"}')])),
        "messages[0].tool_calls[0].function.arguments",
    ),
    "chat call name": (
        "/v1/chat/completions",
        _chat(_assistant(tool_calls=[_call(name="f" + S)])),
        "messages[0].tool_calls[0].function.name",
    ),
    "deprecated function_call": (
        "/v1/chat/completions",
        _chat(_assistant(function_call={"name": "f", "arguments": '{"a": "' + S + '"}'})),
        "messages[0].function_call.arguments",
    ),
    "tool name": ("/v1/chat/completions", _chat(tools=[_tool(name="f" + S)]), "tools[0].function.name"),
    "tool description": (
        "/v1/chat/completions",
        _chat(tools=[_tool(description=S)]),
        "tools[0].function.description",
    ),
    "tool parameters": (
        "/v1/chat/completions",
        _chat(tools=[_tool(parameters={"type": "object", "properties": {"x": {"description": S}}})]),
        "tools[0].function.parameters.properties.x.description",
    ),
    "a key of the parameters": (
        "/v1/chat/completions",
        _chat(tools=[_tool(parameters={"type": "object", "properties": {S: {}}})]),
        "tools[0].function.parameters.properties",
    ),
    "legacy functions": (
        "/v1/chat/completions",
        _chat(functions=[{"name": "f", "description": S}]),
        "functions[0].description",
    ),
    "responses function_call item": (
        "/v1/responses",
        {
            "model": "base",
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": "' + S + '"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
        },
        "input[0].arguments",
    ),
    "responses tool": (
        "/v1/responses",
        {"model": "base", "input": "hi", "tools": [{"type": "function", "name": "f" + S}]},
        "tools[0].name",
    ),
    "responses metadata": (
        "/v1/responses",
        {"model": "base", "input": "hi", "metadata": {"k": S}},
        "metadata.k",
    ),
    "rest call arguments object": (
        "/v1/jobs",
        {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"a": S}}]}, USER]},
        "messages[0].tool_calls[0].arguments.a",
    ),
    "rest tool": (
        "/v1/infer",
        {"prompt": "hi", "tools": [{"name": "f", "description": S}]},
        "tools[0].description",
    ),
}


@pytest.fixture
def parts():
    admission = FakeAdmission()
    return admission, TestClient(create_app(admission, FakeCapacity(), FakeModels()))


@pytest.mark.parametrize("case", list(CASES))
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400_naming_its_field(parts, case):
    admission, http = parts
    path, body, param = CASES[case]
    response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value", error
    assert "lone surrogate" in error["message"] and error["message"].startswith(param), error
    assert admission.requests == []


def test_the_same_bodies_with_valid_text_are_admitted(parts):
    """The refusals above are the surrogate's, not the body's shape."""
    admission, http = parts
    for case in ("chat call arguments", "tool description", "rest tool"):
        path, body, _ = CASES[case]
        content = json.dumps(body).replace("\\ud800", "x")
        response = http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code in (200, 202), (case, response.text)
    assert len(admission.requests) == 3


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", _chat(speculative="yes")),
        ("/v1/completions", {"model": "base", "prompt": "hi", "speculative": "yes"}),
        ("/v1/infer", {"prompt": "hi", "speculative": "yes"}),
        ("/v1/jobs", {"prompt": "hi", "speculative": 1}),
    ],
)
def test_a_flag_that_is_not_a_json_boolean_is_refused_naming_it(parts, path, body):
    admission, http = parts
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "speculative" and error["type"] == "invalid_request_error", error
    assert admission.requests == []
