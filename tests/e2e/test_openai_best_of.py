"""OpenAI's `best_of` and vLLM's beam-search extras on the completions and chat routes, against a
real stack on the tiny model through the official `openai` client."""

from __future__ import annotations

import openai
import pytest

from libs.engine.tokenizer import Tokenizer
from tests.e2e.conftest import openai_client
from tools.stack import LocalStack

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
BEAMS = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True}


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


def test_best_of_answers_the_most_likely_of_its_samples(client, model):
    params = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 21}
    samples = client.completions.create(**params, n=3, logprobs=0).choices
    likelihood = [sum(c.logprobs.token_logprobs) for c in samples]
    assert len(set(likelihood)) == 3  # three different samples
    best = client.completions.create(**params, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == samples[likelihood.index(max(likelihood))].text
    assert best.choices[0].logprobs is None


def test_best_of_greater_than_n_cannot_be_streamed(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of" and info.value.body["code"]


def test_best_of_below_n_is_refused_by_name(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=3, best_of=2)
    assert info.value.body["param"] == "best_of"


def test_beam_search_answers_its_best_beams(client, model):
    extra = {"use_beam_search": True, "length_penalty": 1.0, "early_stopping": False}
    params = {"model": model, "prompt": PROMPT, "max_tokens": 6, "extra_body": extra}
    two = client.completions.create(**params, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    assert all(c.finish_reason in ("stop", "length") for c in two.choices)
    # The best of four beams, and the same search again: beam search is deterministic.
    wide = client.completions.create(**params, n=1, best_of=4)
    assert client.completions.create(**params, n=1, best_of=4).choices[0].text == wide.choices[0].text


def test_beam_search_refuses_sampling_by_name(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=4,
            n=2,
            temperature=0.7,
            extra_body={"use_beam_search": True},
        )
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, extra_body={"early_stopping": "never"}
        )
    assert info.value.body["param"] == "early_stopping"


# -- the chat route: the same fields, the same engine search, over the rendered conversation --------


def test_chat_beam_search_answers_as_completions_of_its_rendered_prompt(client, model, tiny_llama):
    # The chat's prompt is its conversation rendered by the model's template: the same ids sent as a
    # completions prompt run the same search, so the beams must be the same, in the same order.
    rendered = Tokenizer.from_dir(tiny_llama).encode_chat(MESSAGES)
    # best_of is OpenAI's on completions only: its client takes it on chat in extra_body, as vLLM's
    params = {"model": model, "max_tokens": 6, "n": 2, "extra_body": BEAMS | {"best_of": 3}}
    chat = client.chat.completions.create(messages=MESSAGES, **params)
    completion = client.completions.create(prompt=rendered, **params)
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens == len(rendered)
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.text for c in completion.choices]
    assert [c.finish_reason for c in chat.choices] == [c.finish_reason for c in completion.choices]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    assert chat.usage.completion_tokens == completion.usage.completion_tokens


def test_chat_best_of_answers_the_most_likely_of_its_samples(client, model):
    params = {"model": model, "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 21}
    samples = client.chat.completions.create(**params, n=3, logprobs=True).choices
    likelihood = [sum(t.logprob for t in c.logprobs.content) for c in samples]
    assert len(set(likelihood)) == 3  # three different samples
    best = client.chat.completions.create(**params, n=1, extra_body={"best_of": 3})
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].message.content == samples[likelihood.index(max(likelihood))].message.content
    assert best.choices[0].logprobs is None


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True, "extra_body": {"best_of": 2}}, "best_of"),
        ({"stream": True, "n": 2, "extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"n": 2, "tools": TOOLS, "extra_body": {"use_beam_search": True}}, "tools"),
        ({"n": 2, "response_format": {"type": "json_object"}, "extra_body": BEAMS}, "response_format"),
        ({"n": 2, "logprobs": True, "extra_body": {"use_beam_search": True}}, "logprobs"),
        ({"n": 2, "stop": ["."], "extra_body": {"use_beam_search": True}}, "stop"),
        ({"n": 2, "extra_body": {"use_beam_search": True, "early_stopping": "soon"}}, "early_stopping"),
        ({"extra_body": {"length_penalty": 2.0}}, "length_penalty"),
        ({"n": 3, "extra_body": {"best_of": 2}}, "best_of"),
        ({"extra_body": {"use_beam_search": True}}, "best_of"),  # one beam
    ],
)
def test_chat_refuses_what_beams_and_best_of_cannot_combine_with_by_name(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **fields)
    assert info.value.body["param"] == param and info.value.body["code"], info.value.body
