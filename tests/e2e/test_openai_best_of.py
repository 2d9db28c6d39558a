"""OpenAI's `best_of` and vLLM's beam-search extras on the completions route, against a real stack
on the tiny model through the official `openai` client."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import openai_client
from tools.stack import LocalStack

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
