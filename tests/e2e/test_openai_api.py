"""Reception's HTTP front against a real stack on the tiny model: the official `openai` client on
/v1 (chat, completions, streaming, models, errors) and the probes with httpx."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from expert_system import ExpertClient
from tests.e2e.conftest import LONG, openai_client, ready_tiny_stack
from tools.stack import LocalStack

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
FINAL = ("cancelled", "completed", "failed", "timed_out")


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory) -> LocalStack:
    with ready_tiny_stack(tiny_llama, tmp_path_factory.mktemp("openai-stack")) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    with openai_client(stack) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_base_model(client, tiny_llama):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_llama.name]
    assert models.data[0].object == "model" and models.data[0].owned_by


def test_chat_completion_answers_with_usage(client, model):
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0.0)
    assert response.object == "chat.completion" and response.model == model
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_is_raw_text_and_max_tokens_ends_it_with_length(client, model):
    response = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0.0,
        extra_body={"repetition_penalty": 1.0},
    )
    (choice,) = response.choices
    assert response.object == "text_completion" and choice.text
    assert response.usage.completion_tokens == 5 and choice.finish_reason == "length"


def test_chat_stream_with_usage_adds_up_to_the_same_text(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0.0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completion_stream_without_usage(client, model):
    chunks = list(
        client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0.0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_stop_ends_the_text_before_the_stop_string(client, model):
    full = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0.0,
        extra_body={"repetition_penalty": 1.0},
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    stopped = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0.0,
        stop=[stop],
        extra_body={"repetition_penalty": 1.0},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)


def test_the_same_seed_gives_the_same_text(client, model):
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed
        )
        return response.choices[0].message.content

    assert sample(7) == sample(7)


def test_greedy_text_via_http_equals_grpc(client, model, stack):
    params = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0}
    http = client.chat.completions.create(model=model, messages=MESSAGES, **params)
    with ExpertClient(stack.target("reception")) as grpc_client:
        result = grpc_client.infer(messages=MESSAGES, **params)
    assert http.choices[0].message.content == result.text


def test_a_validation_error_is_openais_bad_request_naming_the_param(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=5)
    error = caught.value.body
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    assert "Temperature" in error["message"]


def test_a_bad_type_is_openais_error_not_fastapis(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens="many")
    assert caught.value.body["param"] == "max_tokens"
    response = httpx.post(
        str(client.base_url) + "chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and set(response.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"functions": [{"name": "f"}]}, "functions"),  # deprecated: tools replaces it
        ({"something_else": 1}, "something_else"),
    ],
)
def test_what_is_not_supported_yet_is_refused_naming_the_param(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, extra_body=extra)
    assert caught.value.body["param"] == param


def test_an_expert_in_the_model_name_that_is_not_registered_is_not_found(client, model):
    # `<base>:<expert>` forces the expert (tests/e2e/test_models_and_experts.py); none is registered here.
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=f"{model}:json-parser", messages=MESSAGES)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"


def test_the_probes(stack):
    base = stack.http_url()
    assert httpx.get(base + "/livez").status_code == 200
    ready = httpx.get(base + "/readyz")
    assert ready.status_code == 200 and ready.json()["engines"] == 1
    health = httpx.get(base + "/healthz").json()
    assert health == {"status": "ok", "engines": 1}


def test_a_client_that_leaves_mid_stream_cancels_the_job(stack, model, long_prompt):
    with httpx.stream(
        "POST",
        stack.http_url() + "/v1/completions",
        json={  # runs 1,000 tokens (about a second), so the job is still running when the client leaves
            "model": model,
            "prompt": long_prompt,
            "max_tokens": LONG,
            "temperature": 0.0,
            "repetition_penalty": 1.0,
            "stream": True,
        },
        timeout=30,
    ) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
    job_id = first.split('"id": "cmpl-')[1].split('"')[0]
    with ExpertClient(stack.target("reception")) as grpc_client:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (job := grpc_client.get_job(job_id)).status not in FINAL:
            time.sleep(0.1)
    assert job.status == "cancelled"


def test_a_grpc_stream_that_hangs_up_still_cancels_its_job(stack, long_prompt):
    """InferStream and the HTTP stream share the admission core's `stream`: gRPC keeps its behavior."""
    import grpc

    from libs.gen.expert.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    request = common_pb2.InferenceRequest(  # runs LONG tokens: still running when the client hangs up
        prompt=long_prompt, raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0
    )
    with grpc.insecure_channel(stack.target("reception")) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).InferStream(
            inference_pb2.InferStreamRequest(request=request), timeout=30
        )
        job_id = next(call).submitted.job_id
        next(m for m in call if m.WhichOneof("event") == "delta")
        call.cancel()
    with ExpertClient(stack.target("reception")) as client:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (job := client.get_job(job_id)).status not in FINAL:
            time.sleep(0.1)
    assert job.status == "cancelled"
