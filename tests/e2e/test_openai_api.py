"""Reception's HTTP front against a real stack on the tiny model: the official `openai` client on
/v1 (chat, completions, streaming, models, errors) and the probes with httpx."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from expert_system import ExpertClient
from libs.engine.tokenizer.tokenizer import Tokenizer
from tests.e2e.conftest import LONG, openai_client
from tools.stack import LocalStack

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
FINAL = ("cancelled", "completed", "failed", "timed_out")


@pytest.fixture(scope="module")
def stack(shared_tiny_stack) -> LocalStack:
    return shared_tiny_stack  # it only sends requests: the session's shared stack serves


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


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_not_found(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve(f"{model}:no-such-expert")
    assert refused.value.code == "model_not_found"


def test_token_id_prompts_and_lists_of_prompts_complete_each_prompt(client, model, tiny_llama):
    ids = client.completions.create(model=model, prompt=[40, 41, 42], max_tokens=3, temperature=0.0)
    assert len(ids.choices) == 1 and ids.usage.prompt_tokens == 3  # the ids as they are, nothing added
    # The prompt's text and its token ids (the engine's own encoding) are the same prompt.
    prompt = "Once upon a time"
    tokenizer = Tokenizer.from_dir(tiny_llama)
    encoded = tokenizer.encode(prompt)
    text = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0)
    from_ids = client.completions.create(model=model, prompt=encoded, max_tokens=4, temperature=0.0)
    assert from_ids.choices[0].text == text.choices[0].text
    assert from_ids.usage.prompt_tokens == text.usage.prompt_tokens == len(encoded)
    several = client.completions.create(
        model=model, prompt=[prompt, "A cat", encoded], n=2, max_tokens=4, temperature=0.0
    )
    assert [c.index for c in several.choices] == list(range(6))  # prompt k's choice c is k * n + c
    texts = [c.text for c in several.choices]
    assert texts[0] == texts[1] == texts[4] == texts[5] == text.choices[0].text  # greedy: the same
    assert several.usage.prompt_tokens == 2 * len(encoded) + len(tokenizer.encode("A cat"))


def test_several_prompts_stream_interleaved_by_choice_index(client, model):
    prompts = ["Once upon a time", "A cat"]
    whole = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, temperature=0.0)
    stream = client.completions.create(
        model=model,
        prompt=prompts,
        n=2,
        max_tokens=4,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage, ids = {}, {}, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    # Greedy: each choice streams the text the non-streamed answer has under the same index.
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert len(ids) == 1 and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_token_id_outside_the_vocabulary_is_refused_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=[["a"], [1, 10**6]], max_tokens=2)
    assert refused.value.param == "prompt[0][0]"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=[[1, 2], [3, 10**6]], max_tokens=2)
    assert refused.value.param == "prompt[1][1]", refused.value.body


def test_ignored_fields_pass_and_are_named_in_a_header(client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=MESSAGES,
        max_tokens=2,
        store=True,
        metadata={"run": "7"},
        service_tier="auto",
        extra_body={"reasoning_effort": "low"},
    )
    assert raw.headers["x-expert-ignored-fields"] == "store, metadata, service_tier, reasoning_effort"
    assert raw.parse().choices[0].message.content is not None
    # vLLM's extras the engine has travel through the plan to it (their effect: the engine's tests).
    extras = {"ignore_eos": True, "skip_special_tokens": False}
    past_eos = client.completions.create(
        model=model, prompt="Hi", max_tokens=6, temperature=0.0, extra_body=extras
    )
    assert past_eos.usage.completion_tokens == 6 and past_eos.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=MESSAGES, extra_body={"max_token": 3})
    assert refused.value.code == "unknown_parameter" and refused.value.param == "max_token"


def test_probes_answer_head_and_a_body_that_is_not_json_is_415(stack):
    base = stack.http_url()
    with httpx.Client(base_url=base, timeout=30) as http:
        for path in ("/livez", "/readyz", "/healthz", "/health"):
            answer = http.head(path)
            assert answer.status_code == 200 and answer.content == b"", path
        assert http.get("/health").status_code == 200
        form = http.post("/v1/completions", data={"model": "x", "prompt": "hi"})
        assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
