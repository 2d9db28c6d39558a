"""OpenAI's `n`, logprobs and `response_format` against a real stack on the tiny model, through the
official `openai` client (typed responses and chunks) and raw server-sent events with httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from expert_system import ExpertClient
from tests.e2e.conftest import openai_client
from tools.stack import LocalStack

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time"


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


@pytest.fixture(scope="module")
def grpc_client(stack):
    with ExpertClient(stack.target("reception")) as client:
        yield client


def _by_index(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


def test_chat_with_n_2_and_a_seed_answers_two_reproducible_choices_streamed_alike(client, model):
    params = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2}
    first = client.chat.completions.create(**params)
    assert [c.index for c in first.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") and c.message.role == "assistant" for c in first.choices)
    texts = [c.message.content for c in first.choices]
    assert texts != [texts[0], texts[0]]  # each choice samples on its own
    assert 2 <= first.usage.completion_tokens <= 16
    again = client.chat.completions.create(**params)
    assert [c.message.content for c in again.choices] == texts

    chunks = list(
        client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True})
    )
    assert _by_index(chunks) == dict(enumerate(texts))
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    }
    assert finishes == {c.index: c.finish_reason for c in first.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == first.usage.completion_tokens


def test_completions_with_n_2_a_stop_and_a_seed_stream_like_they_answer(client, model):
    params = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 2}
    whole = client.completions.create(**params)
    assert [c.index for c in whole.choices] == [0, 1]
    stop = whole.choices[0].text[4:7]
    assert stop.strip(), whole.choices[0].text
    stopped = client.completions.create(**params, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert whole.choices[0].text.startswith(stopped.choices[0].text) and stop not in stopped.choices[0].text
    chunks = list(client.completions.create(**params, stop=[stop], stream=True))
    assert _by_index(chunks) == {c.index: c.text for c in stopped.choices}
    finishes = [
        (c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason
    ]
    assert sorted(finishes) == [(c.index, c.finish_reason) for c in stopped.choices]


def test_the_sse_stream_of_n_choices_sends_a_finish_per_choice_and_done_once(stack, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0, "n": 2, "stream": True}
    with httpx.stream("POST", stack.http_url() + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines.count("data: [DONE]") == 1 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert roles == [0, 1] and sorted(finishes) == [0, 1]


def test_greedy_n_2_gives_identical_choices_equal_to_grpc(client, model, grpc_client):
    params = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0}
    http = client.chat.completions.create(model=model, messages=MESSAGES, n=2, **params)
    result = grpc_client.infer(messages=MESSAGES, n=2, **params)
    assert [c.message.content for c in http.choices] == [c.text for c in result.choices] == [result.text] * 2


def test_chat_logprobs_are_the_engines_in_openais_shape_streamed_alike(client, model, grpc_client):
    params = {"max_tokens": 6, "temperature": 0.0}
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, logprobs=True, top_logprobs=2, **params
    )
    content = response.choices[0].logprobs.content
    result = grpc_client.infer(messages=MESSAGES, logprobs=2, **params)
    engine = result.choices[0].logprobs
    assert len(content) == len(engine) == response.usage.completion_tokens
    for shown, token in zip(content, engine, strict=True):
        assert (shown.token, shown.logprob, shown.bytes) == (
            token.token,
            token.logprob,
            list(token.token_bytes),
        )
        assert [(t.token, t.logprob) for t in shown.top_logprobs] == [
            (t.token, t.logprob) for t in token.top_logprobs
        ]
        assert len(shown.top_logprobs) == 2 and shown.logprob <= 0.0
    chunks = client.chat.completions.create(
        model=model, messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True, **params
    )
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == content
    plain = client.chat.completions.create(model=model, messages=MESSAGES, **params)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_are_openais_parallel_lists(client, model):
    params = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "logprobs": 2}
    response = client.completions.create(**params)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    chunks = list(client.completions.create(**params, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == logprobs.tokens
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {
            "type": "json_schema",
            "json_schema": {
                "name": "city",
                "schema": {"type": "object", "required": ["city"]},
                "strict": True,
            },
        },
    ],
)
def test_response_format_is_checked_by_postproc_for_each_choice(client, model, response_format):
    response = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0.0, n=2, response_format=response_format
    )
    body = response.http_response.json()
    # Each choice carries postproc's check against the format (whether it passes is the engine's
    # enforcement, tests/e2e/test_structured_output.py; 6 tokens cut most JSON short anyway).
    validation = body["expert_system"]["validation"]
    assert [(v["index"], v["validator"]) for v in validation] == [(0, "json_schema"), (1, "json_schema")]
    assert all(v["valid"] or v["error"] for v in validation)
    assert response.parse().choices[1].message.content == response.parse().choices[0].message.content


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 5}, "n"),  # valid, but above the engine's EXPERT_MAX_NUM_SEQS (4): the engine refuses it
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ],
)
def test_bad_choices_logprobs_or_response_format_are_openais_errors_naming_the_param(
    client, model, extra, param
):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_completions_logprobs_out_of_range_names_logprobs(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=21)
    assert caught.value.body["param"] == "logprobs"


def test_the_rest_stream_names_each_deltas_choice(stack):
    body = {"prompt": PROMPT, "raw": True, "max_tokens": 4, "temperature": 0.0, "n": 2, "stream": True}
    with httpx.stream("POST", stack.http_url() + "/v1/infer", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e["delta"] for e in events if "delta" in e]
    result = events[-1]["result"]
    for index in (0, 1):
        text = "".join(d["text"] for d in deltas if d.get("index", 0) == index)
        assert text == result["choices"][index]["text"]


def test_the_sdks_stream_names_each_chunks_choice(grpc_client):
    stream = grpc_client.infer_stream(
        PROMPT, raw=True, max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=1
    )
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for chunk in stream:
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        tokens[chunk.index] = tokens.get(chunk.index, 0) + len(chunk.logprobs)
    result = stream.result
    assert texts == {c.index: c.text for c in result.choices} and sorted(texts) == [0, 1]
    assert tokens == {c.index: c.tokens_generated for c in result.choices}
    assert result.tokens_generated == sum(tokens.values())
