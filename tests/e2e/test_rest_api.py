"""Reception's own REST API against a real stack on the tiny model, with httpx: `POST /v1/infer`
(one answer, or server-sent events with `stream: true`) and the async jobs of `/v1/jobs`."""

from __future__ import annotations

import json

import httpx
import pytest

from expert_system import ExpertClient
from tests.e2e.conftest import LONG, wait_rest_job
from tools.stack import LocalStack

FINAL = ("cancelled", "completed", "failed", "timed_out")
QUESTION = {"prompt": "What is the capital of France?", "temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def stack(shared_tiny_stack) -> LocalStack:
    return shared_tiny_stack  # it only sends requests: the session's shared stack serves


@pytest.fixture(scope="module")
def http(stack) -> httpx.Client:
    with httpx.Client(base_url=stack.http_url(), timeout=60) as client:
        yield client


def test_infer_answers_with_the_result(http):
    response = http.post("/v1/infer", json=QUESTION)
    assert response.status_code == 200
    result = response.json()
    assert result["status"] == "completed" and result["text"]
    assert 0 < result["tokens_generated"] <= 8
    assert result["finish_reason"] in ("stop", "length")
    assert isinstance(result["latency_ms"], float) and result["latency_ms"] > 0
    assert isinstance(result["experts_used"], list) and len(result["job_id"]) == 32
    assert result["metrics"]["output_tokens"] == result["tokens_generated"]
    assert isinstance(result["metrics"]["vram_peak_mb"], int)


def test_a_field_violation_is_400_naming_the_field(http):
    response = http.post("/v1/infer", json={**QUESTION, "temperature": 5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "temperature" and error["code"] == "invalid_argument"
    assert "Temperature must be in [0.0, 2.0]" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "nonsense": 1}, "nonsense"),
        ({"prompt": "hi", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"prompt": "", "user_id": "x"}, "prompt"),
    ],
)
def test_a_bad_body_is_400_naming_the_field(http, body, param):
    response = http.post("/v1/infer", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_body_that_is_not_json_is_400(http):
    response = http.post("/v1/jobs", content=b"{nope", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_a_submitted_job_is_polled_until_final(http):
    response = http.post("/v1/jobs", json=QUESTION)
    assert response.status_code == 202
    submission = response.json()
    assert submission["status"] == "queued" and isinstance(submission["estimated_wait_ms"], int)
    assert submission["submitted_at"].endswith("Z")
    assert response.headers["location"] == f"/v1/jobs/{submission['job_id']}"
    job = wait_rest_job(http, submission["job_id"], lambda job: job["status"] in FINAL)
    assert job["status"] == "completed" and job["result"]["status"] == "completed"
    assert job["text"] == job["result"]["text"] and job["finished_at"] >= job["submitted_at"]


def test_delete_cancels_a_running_job(http, long_prompt):
    submission = http.post(
        "/v1/jobs",
        json={
            "prompt": long_prompt,
            "raw": True,
            "temperature": 0.0,
            "max_tokens": LONG,
            "repetition_penalty": 1.0,
        },
    ).json()
    wait_rest_job(http, submission["job_id"], lambda job: job["status"] == "running")
    response = http.delete(f"/v1/jobs/{submission['job_id']}")
    assert response.status_code == 200 and response.json()["job_id"] == submission["job_id"]
    job = wait_rest_job(http, submission["job_id"], lambda job: job["status"] in FINAL)
    assert job["status"] == "cancelled" and job["result"]["finish_reason"] == "abort"
    assert job["result"]["tokens_generated"] < LONG


def test_an_unknown_job_is_404_and_an_invalid_id_400(http):
    for method in ("GET", "DELETE"):
        response = http.request(method, "/v1/jobs/" + "0" * 32)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        response = http.request(method, "/v1/jobs/" + "x" * 65)
        assert response.status_code == 400 and response.json()["error"]["param"] == "job_id"


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((kind, json.loads(line.removeprefix("data: "))))
    return events


def test_stream_sends_the_jobs_events_and_ends_with_the_result(http):
    with http.stream("POST", "/v1/infer", json={**QUESTION, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "submitted" and kinds[-1] == "result" and "delta" in kinds
    assert all(set(data) == {kind} for kind, data in events)  # each is one InferStreamResponse
    assert events[0][1]["submitted"]["status"] == "queued"
    assert "running" in [data["status"] for kind, data in events if kind == "status"]
    result = events[-1][1]["result"]
    assert result["status"] == "completed"
    assert "".join(data["delta"]["text"] for kind, data in events if kind == "delta") == result["text"]


def test_a_refused_stream_is_the_http_error(http):
    response = http.post("/v1/infer", json={**QUESTION, "max_experts": 0, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_experts"


def test_greedy_text_via_rest_equals_grpc(http, stack):
    fields = {"prompt": "Once upon a time", "raw": True, "temperature": 0.0, "max_tokens": 16}
    rest = http.post("/v1/infer", json={**fields, "repetition_penalty": 1.0}).json()
    with ExpertClient(stack.target("reception")) as client:
        grpc = client.infer(**fields, repetition_penalty=1.0)
    assert rest["text"] == grpc.text and rest["tokens_generated"] == grpc.tokens_generated


def test_a_client_that_leaves_the_stream_cancels_the_job(http, long_prompt):
    body = {
        "prompt": long_prompt,
        "raw": True,
        "temperature": 0.0,
        "max_tokens": LONG,
        "repetition_penalty": 1.0,
        "stream": True,
    }
    with http.stream("POST", "/v1/infer", json=body) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        job_id = first["submitted"]["job_id"]
        next(line for line in lines if line.startswith("event: delta"))
    job = wait_rest_job(http, job_id, lambda job: job["status"] in FINAL)
    assert job["status"] == "cancelled" and job["result"]["tokens_generated"] < LONG
