"""Reception's HTTP front in process, over a fake admission core: the mapping of OpenAI's fields onto
an InferenceRequest, and of every error onto OpenAI's error body (tests/e2e/test_openai_api.py runs
it against a real stack)."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient

from libs.errors import ServiceError, invalid_arguments
from libs.gen.expert.v1 import common_pb2, preparation_pb2
from services.reception.admission.core import Submitted
from services.reception.http import create_app
from services.reception.http.openai_request import to_request
from services.reception.http.openai_schema import ChatCompletionRequest, CompletionRequest
from services.reception.job_events import Delta, Finished, Restarted, StatusChanged


class FakeAdmission:
    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.result = common_pb2.InferenceResult(
            job_id="j1",
            status=common_pb2.JOB_STATUS_COMPLETED,
            text="Paris",
            finish_reason=common_pb2.FINISH_REASON_TIMEOUT,
            metrics=common_pb2.InferenceMetrics(input_tokens=7, output_tokens=2),
        )
        self.requests: list[common_pb2.InferenceRequest] = []
        self.restart = False

    async def infer(self, request):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        return self.result

    async def stream(self, request):
        """The job's events: each choice's text in two deltas (one token each), or its tool calls'
        pieces as the engine sends them (the name, then the arguments in two), then the result;
        `restart` inserts a restart after the first delta."""
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        yield Submitted(
            common_pb2.JobSubmission(job_id=self.result.job_id, status=common_pb2.JOB_STATUS_QUEUED)
        )
        yield StatusChanged(common_pb2.JOB_STATUS_RUNNING)
        for choice in self.result.choices or [common_pb2.Choice(text=self.result.text)]:
            if choice.tool_calls:
                yield Delta(common_pb2.ChoiceDelta(index=choice.index, tool_calls=_pieces(choice.tool_calls)))
                continue
            for i, token in enumerate(choice.logprobs or [common_pb2.TokenLogprob(token=choice.text)]):
                yield Delta(common_pb2.ChoiceDelta(index=choice.index, text=token.token, logprobs=[token]))
                if self.restart and i == 0:
                    yield Restarted(2)
        yield Finished(self.result)


def _pieces(calls) -> list[common_pb2.ToolCallDelta]:
    pieces = []
    for k, call in enumerate(calls):
        half = len(call.arguments) // 2
        pieces.append(common_pb2.ToolCallDelta(index=k, id=call.id, name=call.name))
        pieces += [
            common_pb2.ToolCallDelta(index=k, arguments=part)
            for part in (call.arguments[:half], call.arguments[half:])
        ]
    return pieces


class FakeCapacity:
    engines = 1

    async def get(self):
        return preparation_pb2.GetCapacityResponse(engines=self.engines)


class FakeModels:
    async def names(self):
        return ["base", "base:json", "base:sql"]


@pytest.fixture
def parts():
    admission, capacity = FakeAdmission(), FakeCapacity()
    return admission, capacity, TestClient(create_app(admission, capacity, FakeModels()))


CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_answer_has_usage_and_a_timeout_finishes_with_length(parts):
    _, _, http = parts
    body = http.post("/v1/chat/completions", json=CHAT).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["id"] == "chatcmpl-j1" and body["expert_system"]["job_id"] == "j1"


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_service_errors_become_openai_errors(parts, code, status):
    admission, _, http = parts
    admission.error = ServiceError(code, "no")
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_an_unexpected_failure_is_a_500_in_openais_shape(parts):
    admission, _, http = parts
    admission.error = RuntimeError("boom")
    response = http.post("/v1/completions", json={"model": "base", "prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "field, body, param",
    [
        ("request.user_id", CHAT, "user"),
        ("request.prompt", CHAT, "messages"),
        ("request.messages[0].role", CHAT, "messages[0].role"),
        ("request.max_tokens", {**CHAT, "max_completion_tokens": 9}, "max_completion_tokens"),
        ("request.max_tokens", {"model": "base", "prompt": "x"}, "max_tokens"),
        ("request.response_format.regex", CHAT, "response_format.regex"),
        ("request.response_format.grammar", {"model": "base", "prompt": "x"}, "response_format.grammar"),
        ("request.response_format.json_schema.schema", CHAT, "response_format.json_schema.schema"),
        ("request.response_format.json_schema.name", CHAT, "response_format.json_schema.name"),
    ],
)
def test_a_violation_names_the_field_as_the_client_sent_it(parts, field, body, param):
    admission, _, http = parts
    admission.error = invalid_arguments([(field, "bad")])
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = http.post(path, json=body).json()["error"]
    assert error["param"] == param and error["message"] == f"{param}: bad"


def test_bad_bodies_and_unknown_paths_answer_in_openais_shape(parts):
    _, _, http = parts
    for response, status in [
        (http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}), 400),
        (http.post("/v1/chat/completions", json={**CHAT, "stop": 3}), 400),
        (http.post("/v1/chat/completions", json={"model": "base"}), 400),
        (http.get("/v1/nothing"), 404),
    ]:
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert http.post("/v1/chat/completions", json={**CHAT, "stop": 3}).json()["error"]["param"] == "stop"
    assert http.post("/v1/chat/completions", json={"model": "base"}).json()["error"]["param"] == "messages"


def test_readyz_waits_for_an_engine(parts):
    _, capacity, http = parts
    capacity.engines = 0
    assert http.get("/readyz").status_code == 503
    assert http.get("/healthz").json() == {"status": "degraded", "engines": 0}
    assert http.get("/livez").status_code == 200
    capacity.engines = 2
    assert http.get("/readyz").json() == {"status": "ready", "serving": True, "engines": 2}


def test_openai_fields_map_onto_the_inference_request():
    chat = ChatCompletionRequest(
        model="base",
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        max_tokens=5,
        max_completion_tokens=6,
        temperature=0.5,
        stop="x",
        seed=3,
        user="u",
        top_k=-1,
        force_experts=["e"],
        priority=7,
    )
    request = to_request(chat)
    assert [(m.role, m.content) for m in request.messages] == [("system", "ab")]
    assert (request.max_tokens, request.temperature, list(request.stop), request.seed) == (6, 0.5, ["x"], 3)
    assert (request.user_id, request.top_k, list(request.force_experts), request.priority) == (
        "u",
        0,
        ["e"],
        7,
    )
    assert not request.HasField("top_p") and not request.raw
    completion = to_request(CompletionRequest(model="base", prompt=["p"], stop=["a", "b"]))
    assert (completion.prompt, completion.raw, list(completion.stop)) == ("p", True, ["a", "b"])


def test_models_lists_each_registered_expert_after_the_base_model(parts):
    _, _, http = parts
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids == ["base", "base:json", "base:sql"]


def test_an_expert_in_the_model_name_is_forced_first_and_merged_with_force_experts(parts):
    admission, _, http = parts
    body = {**CHAT, "model": "base:json", "force_experts": ["sql", "json"]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["model"] == "base:json"
    assert list(admission.requests[-1].force_experts) == ["json", "sql"]
    assert admission.requests[-1].model == "base"  # the base model serves it, the expert forced


@pytest.mark.parametrize(
    "field, detail, status, param, code",
    [
        (
            "request.force_experts[0]",
            "unknown expert 'nope' (not registered)",
            404,
            "model",
            "model_not_found",
        ),
        ("request.force_experts[0]", "must not be empty", 404, "model", "model_not_found"),
        ("request.model", "no engine serves the model 'base'", 404, "model", "model_not_found"),
        ("request.force_experts[1]", "unknown expert 'sql' (not registered)", 400, "force_experts[0]", None),
    ],
)
def test_a_refused_expert_from_the_model_name_names_model(parts, field, detail, status, param, code):
    admission, _, http = parts
    admission.error = invalid_arguments([(field, detail)])
    body = {**CHAT, "model": "base:nope", "force_experts": ["sql"]}
    response = http.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param
    assert error["message"] == f"{param}: {detail}"
    assert code is None or error["code"] == code


def test_a_key_over_its_limit_is_429_with_retry_after_in_whole_seconds(parts):
    from libs.errors import resource_exhausted

    admission, _, client = parts
    admission.error = resource_exhausted("API key k is over its limit of 5 requests per minute", 11.2)
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 429 and response.headers["Retry-After"] == "12"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_an_unreachable_key_store_is_503_not_a_traceback_and_the_probes_need_no_key():
    from libs.auth.config import AuthConfig
    from libs.auth.keys import KeyStore
    from libs.auth.policy import Authenticator
    from libs.redis_client import connect, map_redis_error

    auth = Authenticator(
        AuthConfig("required", "0123456789abcdef0123"), {}, KeyStore(connect("redis://127.0.0.1:1/0"))
    )
    client = TestClient(create_app(FakeAdmission(), FakeCapacity(), FakeModels(), map_redis_error, auth=auth))
    assert client.get("/livez").status_code == 200
    missing = client.get("/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    down = client.get("/v1/models", headers={"Authorization": "Bearer esk_0123456789ab_" + "x" * 43})
    assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable_error"


def test_every_refusal_carries_a_code_and_a_body_that_is_not_json_is_415(parts):
    _, _, http = parts
    for response, status, code in [
        (http.post("/v1/chat/completions", json={**CHAT, "stream_options": {}}), 400, "invalid_value"),
        (http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2}), 400, "invalid_value"),
        (http.get("/v1/nothing"), 404, "not_found"),
        (http.delete("/v1/models"), 405, "method_not_allowed"),
        (
            http.post("/v1/chat/completions", content=b"model=base", headers={"content-type": "text/plain"}),
            415,
            None,
        ),
        (http.post("/v1/completions", data={"model": "base", "prompt": "x"}), 415, None),
        (http.post("/v1/completions", content=b'{"model": "base", "prompt": "x"}'), 415, None),
    ]:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == (code or "unsupported_media_type")
        assert error["type"] == "invalid_request_error"
    says = http.post("/v1/completions", data={"model": "base"}).json()["error"]["message"]
    assert "Content-Type: application/json" in says and "x-www-form-urlencoded" in says
    # JSON under its +json names too, and an empty body (a cancel's POST) needs no Content-Type.
    content = b'{"model": "base", "messages": [{"role": "user", "content": "hi"}]}'
    json_ld = {"content-type": "application/ld+json; charset=utf-8"}
    assert http.post("/v1/chat/completions", content=content, headers=json_ld).status_code == 200
    assert http.post("/v1/chat/completions").json()["error"]["code"] != "unsupported_media_type"


def test_every_probe_answers_head_and_health_is_vllms(parts):
    _, capacity, http = parts
    for path in ("/livez", "/readyz", "/healthz", "/health"):
        assert http.head(path).status_code == 200, path
    assert http.get("/health").status_code == 200 and http.get("/health").content == b""
    capacity.engines = 0
    assert http.head("/readyz").status_code == 503 and http.get("/health").status_code == 503
    assert http.head("/health").status_code == 503 and http.head("/livez").status_code == 200


def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_404_model_not_found(parts):
    _, _, http = parts
    for name in ("base", "base:json"):
        model = http.get(f"/v1/models/{name}").json()
        assert model["id"] == name and model["object"] == "model" and model["owned_by"] == "expert-system"
    response = http.get("/v1/models/base:nope")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "the model 'base:nope' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
