"""Reception's HTTP front in process, at its edges: bodies bounded in bytes and nesting before any
parser (body_guard.py), text no UTF-8 can carry refused by field (body_text.py), every unparsable
body in OpenAI's shape, /readyz following the service's health, and a caller cut off by a stop
told its job (tests/e2e/test_http_limits.py runs the same against a real stack)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from libs.config import ConfigError
from services.reception.admission.core import JobHandedBack
from services.reception.config import ReceptionConfig
from services.reception.http import create_app
from services.reception.http.body_guard import MAX_JSON_DEPTH, nested_deeper_than
from tests.unit.test_http_api import CHAT, FakeAdmission, FakeCapacity, FakeModels

LIMIT = 8192


@pytest.fixture
def parts():
    admission, capacity = FakeAdmission(), FakeCapacity()
    state = {"serving": True}
    app = create_app(
        admission, capacity, FakeModels(), max_body_bytes=LIMIT, serving=lambda: state["serving"]
    )
    return admission, state, TestClient(app)


def _post(http: TestClient, path: str, content, **headers) -> dict:
    response = http.post(path, content=content, headers={"content-type": "application/json", **headers})
    return {"status": response.status_code, **response.json()}


def _chunks(size: int):
    yield b'{"model": "base", "messages": [{"role": "user", "content": "'
    for _ in range(size // 1024):
        yield b"x" * 1024
    yield b'"}]}'


def test_a_body_over_the_limit_is_a_413_in_openais_shape_whether_declared_or_streamed(parts):
    admission, _, http = parts
    for content in (b"{" + b" " * LIMIT + b"}", _chunks(LIMIT * 4)):  # a Content-Length, then chunked
        answer = _post(http, "/v1/chat/completions", content)
        assert answer["status"] == 413, answer
        assert answer["error"]["code"] == "request_too_large"
        assert answer["error"]["type"] == "invalid_request_error"
        assert str(LIMIT) in answer["error"]["message"]
    assert admission.requests == []


def test_a_body_at_the_limit_is_read(parts):
    admission, _, http = parts
    body = json.dumps(CHAT).encode()
    body = body[:-1] + b" " * (LIMIT - len(body)) + b"}"
    assert len(body) == LIMIT
    assert _post(http, "/v1/chat/completions", body)["status"] == 200
    assert len(admission.requests) == 1


def test_a_body_nested_past_the_bound_is_refused_before_any_parser(parts):
    _, _, http = parts
    for depth in (MAX_JSON_DEPTH + 1, 1000):  # 1000: Python's own parser raises RecursionError there
        nested = "[" * depth + "]" * depth
        answer = _post(
            http, "/v1/chat/completions", json.dumps({**CHAT, "stop": nested})[:-1] + ', "x": ' + nested + "}"
        )
        assert answer["status"] == 400 and answer["error"]["code"] == "invalid_json", answer
        assert f"deeper than {MAX_JSON_DEPTH}" in answer["error"]["message"]


def test_a_schema_nested_within_the_bound_reaches_the_route(parts):
    admission, _, http = parts
    schema: dict = {"type": "string"}
    for _ in range(60):
        schema = {"type": "array", "items": schema}
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    assert (
        _post(http, "/v1/chat/completions", json.dumps({**CHAT, "response_format": response_format}))[
            "status"
        ]
        == 200
    )
    assert admission.requests[-1].response_format.json_schema.name == "deep"


def test_json_depth_counts_only_the_brackets_outside_strings():
    assert nested_deeper_than(b"[" * 5 + b"]" * 5, 4)
    assert not nested_deeper_than(b"[" * 4 + b"]" * 4, 4)
    assert nested_deeper_than(b'{"a": [{"b": [1]}]}', 3) and not nested_deeper_than(b'{"a": [{"b": [1]}]}', 4)
    # brackets inside strings, escaped quotes and backslashes included, are text
    text = b'{"a": "[[[[[[\\"[[[[[[\\\\", "b": [[1]], "c": "\\\\"}'
    assert not nested_deeper_than(text, 3)
    assert nested_deeper_than(text, 2)
    # many brackets side by side are wide, not deep; deep without a run of openings is still deep
    assert not nested_deeper_than(b"[" + b"[]," * 10_000 + b"[]]", 2)
    comb = b"".join(b"[[[]]," for _ in range(200)) + b"]" * 200
    assert nested_deeper_than(comb, 128) and not nested_deeper_than(comb, 202)


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", {**CHAT, "stop": ["ok", "\udfff"]}, "stop[1]"),
        ("/v1/chat/completions", {**CHAT, "user": "\ud800"}, "user"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "regex", "regex": "\ud800"}},
            "response_format.regex",
        ),
        ("/v1/completions", {"model": "base", "prompt": ["\ud800"]}, "prompt[0]"),
        ("/v1/infer", {"prompt": "hi \ud800"}, "prompt"),
        ("/v1/jobs", {"prompt": "hi", "template": "\ud800"}, "template"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(parts, path, body, param):
    admission, _, http = parts
    answer = _post(http, path, json.dumps(body))  # json.dumps writes the surrogate as "\ud800"
    assert answer["status"] == 400, answer
    assert answer["error"]["param"] == param and "surrogate" in answer["error"]["message"], answer
    assert admission.requests == []


def test_an_unknown_field_named_with_a_lone_surrogate_is_refused_and_the_answer_is_json(parts):
    _, _, http = parts
    answer = _post(http, "/v1/chat/completions", json.dumps({**CHAT, "x\ud800": 1}))
    assert answer["status"] == 400 and "surrogate" in answer["error"]["message"], answer


@pytest.mark.parametrize(
    "content, says",
    [
        (b'{"model": "base\xff", "prompt": "x"}', "utf-8"),
        (b'{"model": "base", "prompt": "x", "seed": ' + b"9" * 4400 + b"}", "digits"),
        (b'{"model": ', "Expecting value"),
    ],
)
def test_an_unparsable_body_is_invalid_json_in_openais_shape(parts, content, says):
    _, _, http = parts
    for path in ("/v1/completions", "/v1/infer"):
        answer = _post(http, path, content)
        assert answer["status"] == 400 and answer["error"]["code"] == "invalid_json", answer
        assert says in answer["error"]["message"]


def test_readyz_follows_the_services_health(parts):
    _, state, http = parts
    assert http.get("/readyz").status_code == 200
    state["serving"] = False  # Redis unreachable, or reception stopping: gRPC health NOT_SERVING
    response = http.get("/readyz")
    assert response.status_code == 503 and response.json()["serving"] is False


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/infer", {"prompt": "hi"})])
def test_a_call_cut_off_by_a_stop_gets_a_503_with_its_job_id(parts, path, body):
    admission, _, http = parts
    admission.error = JobHandedBack("j42")
    response = http.post(path, json=body)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    answer = response.json()
    assert answer["expert_system"] == {"job_id": "j42"} and "j42" in answer["error"]["message"]
    assert answer["error"]["code"] == "unavailable"


def test_the_body_limit_is_read_from_the_environment():
    assert ReceptionConfig.from_env({}).http_max_body_bytes == 4 * 1024 * 1024
    assert ReceptionConfig.from_env({"EXPERT_HTTP_MAX_BODY_BYTES": "65536"}).http_max_body_bytes == 65536
    with pytest.raises(ConfigError, match="EXPERT_HTTP_MAX_BODY_BYTES"):
        ReceptionConfig.from_env({"EXPERT_HTTP_MAX_BODY_BYTES": "10"})
