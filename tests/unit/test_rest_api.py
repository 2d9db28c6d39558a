"""The REST API (`/v1/infer`, `/v1/jobs`) in process, over a fake admission core: the JSON <-> proto
mapping and the errors (tests/e2e/test_rest_api.py runs it against a real stack)."""

from __future__ import annotations

import json

import grpc
import pytest
from fastapi.testclient import TestClient

from libs.errors import ServiceError, invalid_argument, invalid_arguments, not_found
from libs.gen.expert.v1 import common_pb2, preparation_pb2
from libs.timestamps import timestamp
from services.reception.admission.core import Submitted
from services.reception.http import create_app
from services.reception.http.rest import to_json, to_request
from services.reception.http.rest_schema import JobBody
from services.reception.job_events import Delta, Finished, StatusChanged

RESULT = common_pb2.InferenceResult(
    job_id="j1",
    status=common_pb2.JOB_STATUS_COMPLETED,
    text="Paris",
    tokens_generated=2,
    experts_used=["english"],
    latency_ms=850.0,
    finish_reason=common_pb2.FINISH_REASON_STOP,
    metrics=common_pb2.InferenceMetrics(vram_peak_mb=12, submitted_at=timestamp(0.0)),
)


class FakeAdmission:
    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.requests: list[common_pb2.InferenceRequest] = []
        self.asked: list[tuple[str, str]] = []

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    async def infer(self, request):
        self.requests.append(request)
        self._check()
        return RESULT

    async def stream(self, request):
        self.requests.append(request)
        self._check()
        yield Submitted(common_pb2.JobSubmission(job_id="j1", status=common_pb2.JOB_STATUS_QUEUED))
        yield StatusChanged(common_pb2.JOB_STATUS_RUNNING)
        yield Delta(common_pb2.ChoiceDelta(text="Par"))
        yield Delta(common_pb2.ChoiceDelta(text="is"))
        yield Finished(RESULT)

    async def submit(self, request):
        self.requests.append(request)
        self._check()
        return common_pb2.JobSubmission(
            job_id="j1", status=common_pb2.JOB_STATUS_QUEUED, estimated_wait_ms=1500
        )

    async def get_job(self, job_id):
        self.asked.append(("get", job_id))
        self._check()
        return common_pb2.Job(job_id=job_id, status=common_pb2.JOB_STATUS_RUNNING, text="Pa")

    async def cancel_job(self, job_id):
        self.asked.append(("cancel", job_id))
        self._check()
        return common_pb2.Job(job_id=job_id, status=common_pb2.JOB_STATUS_CANCELLED)


class FakeCapacity:
    async def get(self):
        return preparation_pb2.GetCapacityResponse(engines=1)


class FakeModels:
    async def names(self):
        return ["base", "base:json"]


@pytest.fixture
def parts():
    admission = FakeAdmission()
    return admission, TestClient(create_app(admission, FakeCapacity(), FakeModels()))


def test_every_field_maps_onto_the_request_under_its_proto_name():
    fields = {
        "prompt": "p",
        "template": "t {prompt}",
        "body": "b",
        "temperature": 0.5,
        "max_tokens": 9,
        "top_p": 0.5,
        "top_k": 3,
        "min_p": 0.25,
        "repetition_penalty": 1.5,
        "force_experts": ["a"],
        "exclude_experts": ["b"],
        "max_experts": 2,
        "context_size": 100,
        "user_id": "u",
        "priority": 7,
        "timeout_ms": 2**40,
        "stop": ["\n"],
        "seed": 2**63,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "messages": [{"role": "system", "content": "s"}],
        "raw": False,
        "json_schema": "{}",
        "prompt_token_ids": [1, 2],
    }
    request = to_request(JobBody(**fields))
    mapped = to_json(request)
    # Fields the REST body does not take print at their defaults: no tools, messages without a
    # name or tool calls.
    assert mapped.pop("tools") == []
    mapped["messages"] = [{k: v for k, v in m.items() if v not in ("", [])} for m in mapped["messages"]]
    assert mapped == fields


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"json_object": {}}),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},  # no name: ours allows it
            {"json_schema": {"schema": '{"type": "object"}'}},
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": '{"type": "object"}', "strict": True},
            },
            {
                "json_schema": {"name": "p", "schema": '{"type": "object"}', "strict": True}
            },  # text, as json_schema
        ),
        ({"type": "regex", "regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"type": "grammar", "grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
    ],
)
def test_response_format_takes_openais_shape_with_the_regex_and_grammar_types(
    parts, response_format, expected
):
    admission, http = parts
    assert (
        http.post("/v1/infer", json={"prompt": "hi", "response_format": response_format}).status_code == 200
    )
    request = admission.requests[-1]
    if expected is None:
        assert not request.HasField("response_format")
    else:
        assert request.response_format == common_pb2.ResponseFormat(**expected)


def test_a_refused_format_names_its_part_as_sent(parts):
    admission, http = parts
    admission.error = invalid_arguments([("request.response_format.regex", "must not be empty")])
    body = {"prompt": "hi", "response_format": {"type": "regex", "regex": ""}}
    error = http.post("/v1/jobs", json=body).json()["error"]
    assert (error["param"], error["message"]) == (
        "response_format.regex",
        "response_format.regex: must not be empty",
    )
    admission.error = invalid_arguments(
        [("request.json_schema", "set either json_schema or response_format")]
    )
    assert http.post("/v1/jobs", json={"prompt": "hi"}).json()["error"]["param"] == "json_schema"


def test_unset_fields_stay_unset():
    request = to_request(JobBody(prompt="p"))
    assert not request.HasField("temperature") and not request.HasField("priority")


def test_results_use_short_enums_numbers_and_timestamps():
    data = to_json(RESULT)
    assert data["status"] == "completed" and data["finish_reason"] == "stop"
    assert data["metrics"]["vram_peak_mb"] == 12 and data["metrics"]["submitted_at"].endswith("Z")
    assert {"job_id", "text", "tokens_generated", "experts_used", "latency_ms"} <= set(data)


def test_infer_returns_the_result(parts):
    admission, http = parts
    response = http.post("/v1/infer", json={"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 200 and response.json() == to_json(RESULT)
    assert admission.requests[0].max_tokens == 4


def test_stream_sends_each_event(parts):
    _, http = parts
    response = http.post("/v1/infer", json={"prompt": "hi", "stream": True})
    blocks = [b for b in response.text.split("\n\n") if b]
    events = [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1][6:])) for b in blocks]
    assert [kind for kind, _ in events] == ["submitted", "status", "delta", "delta", "result"]
    assert events[1][1] == {"status": "running"} and events[2][1] == {
        "delta": {"index": 0, "text": "Par", "logprobs": [], "tool_calls": []}
    }
    assert events[-1][1]["result"]["text"] == "Paris"


def test_jobs_submit_get_and_cancel(parts):
    admission, http = parts
    response = http.post("/v1/jobs", json={"prompt": "hi"})
    assert response.status_code == 202 and response.headers["location"] == "/v1/jobs/j1"
    assert response.json()["status"] == "queued" and response.json()["estimated_wait_ms"] == 1500
    assert http.get("/v1/jobs/j1").json()["text"] == "Pa"
    assert http.delete("/v1/jobs/j1").json()["status"] == "cancelled"
    assert admission.asked == [("get", "j1"), ("cancel", "j1")]


@pytest.mark.parametrize(
    "error, status, param",
    [
        (invalid_arguments([("request.user_id", "bad")]), 400, "user_id"),
        (invalid_argument("job_id", "too long"), 400, "job_id"),
        (not_found("job 'x' does not exist (or expired)"), 404, None),
        (ServiceError(grpc.StatusCode.UNAVAILABLE, "redis"), 503, None),
    ],
)
def test_service_errors_keep_the_proto_field_names(parts, error, status, param):
    admission, http = parts
    admission.error = error
    for response in (
        http.post("/v1/infer", json={"prompt": "hi"}),
        http.post("/v1/infer", json={"prompt": "hi", "stream": True}),
        http.post("/v1/jobs", json={"prompt": "hi"}),
        http.get("/v1/jobs/x"),
        http.delete("/v1/jobs/x"),
    ):
        assert response.status_code == status
        assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"prompt": "hi", "temperature": "hot"}, "temperature", "invalid_type"),
        ({"prompt": "hi", "temperature": 1e300}, "temperature", "invalid_type"),
        ({"prompt": "hi", "max_tokens": 2**31}, "max_tokens", "invalid_type"),
        ({"prompt": "hi", "stop": "x"}, "stop", "invalid_type"),
        ({"prompt": "hi", "modle": "x"}, "modle", "unknown_parameter"),
        ({"prompt": "hi", "response_format": "json"}, "response_format", "invalid_type"),
        ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        (
            {"prompt": "hi", "response_format": {"type": "regex", "regex": 1}},
            "response_format.regex",
            "invalid_value",
        ),
        (
            {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
            "response_format.json_schema.schema",
            "invalid_value",
        ),
        (
            {"prompt": "hi", "response_format": {"type": "grammar", "grammar": "g", "x": 1}},
            "response_format.x",
            "unknown_parameter",
        ),
        ({"prompt": "hi", "messages": [{"role": "user"}]}, "messages[0].content", "invalid_type"),
        ({"prompt": "hi", "tools": [{"name": "f"}], "tool_choice": "always"}, "tool_choice", "invalid_type"),
        ({"prompt": "hi", "tools": [{"name": "f", "kind": 1}]}, "tools[0].kind", "unknown_parameter"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(parts, body, param, code):
    _, http = parts
    for path in ("/v1/infer", "/v1/jobs"):
        response = http.post(path, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == code


def test_jobs_take_no_stream_field(parts):
    _, http = parts
    response = http.post("/v1/jobs", json={"prompt": "hi", "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"


def test_tools_take_the_protos_fields_with_schemas_as_objects():
    body = JobBody.model_validate(
        {
            "prompt": "hi",
            "tools": [{"name": "add", "parameters": {"type": "object"}}, {"name": "sub", "parameters": "{}"}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "c1", "name": "add", "arguments": {"a": 1}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "1", "name": "add"},
            ],
        }
    )
    request = to_request(body)
    assert [(t.name, json.loads(t.parameters)) for t in request.tools] == [
        ("add", {"type": "object"}),
        ("sub", {}),
    ]
    assert (
        request.tool_choice.mode == common_pb2.TOOL_CHOICE_MODE_REQUIRED and not request.parallel_tool_calls
    )
    call = request.messages[0].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("c1", "add", {"a": 1})
    assert (request.messages[1].tool_call_id, request.messages[1].name) == ("c1", "add")
    named = to_request(
        JobBody.model_validate({"prompt": "hi", "tools": [{"name": "f"}], "tool_choice": {"function": "f"}})
    )
    assert named.tool_choice.function == "f"
    calls = common_pb2.InferenceResult(
        choices=[
            common_pb2.Choice(
                tool_calls=[common_pb2.ToolCall(id="c", type="function", name="f", arguments="{}")]
            )
        ]
    )
    assert to_json(calls)["choices"][0]["tool_calls"] == [
        {"id": "c", "type": "function", "name": "f", "arguments": "{}"}
    ]
