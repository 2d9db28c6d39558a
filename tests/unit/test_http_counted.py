"""Reception's HTTP front in process, over the fake admission core of test_http_api.py, with its own
metrics registry: the ignored fields (the header, the count) and the refusals counted with gRPC's
labels. tests/e2e/test_openai_api.py sends the same fields with the real openai client."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from libs.auth.config import AuthConfig
from libs.auth.policy import Authenticator
from services.reception.http import create_app
from services.reception.metrics import ReceptionMetrics
from tests.unit.test_http_api import CHAT, FakeAdmission, FakeCapacity, FakeModels


@pytest.fixture
def counted():
    registry = CollectorRegistry()
    metrics = ReceptionMetrics(registry)
    http = TestClient(
        create_app(FakeAdmission(), FakeCapacity(), FakeModels(), metrics=metrics, max_body_bytes=4096)
    )

    def count(name: str, field: str) -> float:
        return registry.get_sample_value(name, {"field": field}) or 0.0

    return http, count


IGNORED = {
    "store": True,
    "metadata": {"run": "7"},
    "service_tier": "auto",
    "reasoning_effort": "low",
    "prediction": {"type": "content", "content": "x"},
    "modalities": ["text"],
}


def test_ignored_fields_are_named_once_in_a_header_and_counted(counted):
    http, count = counted
    response = http.post("/v1/chat/completions", json={**CHAT, **IGNORED, "metadata": None})
    assert response.status_code == 200, response.text
    # null is as good as not sent: metadata is not named
    assert (
        response.headers["x-expert-ignored-fields"]
        == "store, service_tier, reasoning_effort, prediction, modalities"
    )
    stream = http.post(
        "/v1/completions", json={"model": "base", "prompt": "x", "store": False, "stream": True}
    )
    assert stream.headers["x-expert-ignored-fields"] == "store"
    assert count("expert_reception_ignored_fields_total", "store") == 2
    assert count("expert_reception_ignored_fields_total", "metadata") == 0
    assert "x-expert-ignored-fields" not in http.post("/v1/chat/completions", json=CHAT).headers


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"modalities": ["text", "audio"]}, "modalities[1]"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"metadata": "not an object"}, "metadata"),
        ({"storee": True}, "storee"),
    ],
)
def test_what_would_change_the_answer_stays_refused_with_its_param(counted, extra, param):
    http, _ = counted
    error = http.post("/v1/chat/completions", json={**CHAT, **extra}).json()["error"]
    assert error["param"] == param, error


def test_http_refusals_are_counted_with_grpcs_labels(counted):
    http, count = counted
    rejected = "expert_reception_requests_rejected_total"
    http.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"})
    http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": 1}]})
    http.post("/v1/chat/completions", json={**CHAT, "surprise": 1})
    http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 3})
    for content, headers in [
        (b"{", {"content-type": "application/json"}),  # not JSON
        (b"x" * 5000, {"content-type": "application/json"}),  # over 4096 bytes
        (b'{"model": "base"}', {"content-type": "text/plain"}),  # 415
    ]:
        assert http.post("/v1/completions", content=content, headers=headers).status_code >= 400
    http.get("/v1/nowhere")  # an unknown path is no refused request
    assert count(rejected, "request.temperature") == 1
    assert count(rejected, "request.messages") == 1
    assert count(rejected, "request.top_logprobs") == 1
    assert count(rejected, "unknown_field") == 1 and count(rejected, "request.surprise") == 0
    assert count(rejected, "body") == 3


def test_a_refused_key_is_counted_as_authorization():
    registry = CollectorRegistry()
    # No key store: the missing key is refused before one would be asked.
    auth = Authenticator(AuthConfig("required", "0123456789abcdef0123"), {})
    app = create_app(
        FakeAdmission(), FakeCapacity(), FakeModels(), auth=auth, metrics=ReceptionMetrics(registry)
    )
    assert TestClient(app).post("/v1/chat/completions", json=CHAT).status_code == 401
    assert (
        registry.get_sample_value("expert_reception_requests_rejected_total", {"field": "authorization"}) == 1
    )


def test_a_key_over_its_limits_is_counted_by_admission_for_both_fronts():
    import asyncio

    import grpc

    from libs.errors import ServiceError
    from libs.gen.expert.v1 import common_pb2
    from services.reception.admission.core import Admission

    class Refusing:  # the real KeyLimiter needs Redis: tests/integration/test_auth.py runs it
        async def admit(self, caller):
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit", retry_after_s=1.0)

    registry = CollectorRegistry()
    admission = Admission(None, None, None, ReceptionMetrics(registry), limiter=Refusing())
    with pytest.raises(ServiceError):
        asyncio.run(admission.admit(common_pb2.InferenceRequest(prompt="hi")))
    assert registry.get_sample_value("expert_reception_requests_rejected_total", {"field": "rate_limit"}) == 1


def test_vllms_ignore_eos_and_skip_special_tokens_are_taken_and_min_tokens_refused_by_name(counted):
    from services.reception.http.openai_request import to_request
    from services.reception.http.openai_schema import CompletionRequest

    taken = to_request(
        CompletionRequest(model="base", prompt="x", ignore_eos=True, skip_special_tokens=False)
    )
    assert taken.ignore_eos and taken.HasField("skip_special_tokens") and not taken.skip_special_tokens
    plain = to_request(CompletionRequest(model="base", prompt="x"))
    assert not plain.HasField("ignore_eos") and not plain.HasField("skip_special_tokens")
    http, _ = counted
    assert (
        http.post("/v1/completions", json={"model": "base", "prompt": "x", "min_tokens": 0}).status_code
        == 200
    )
    error = http.post("/v1/completions", json={"model": "base", "prompt": "x", "min_tokens": 4}).json()[
        "error"
    ]
    assert (error["param"], error["code"]) == ("min_tokens", "unsupported_parameter")
