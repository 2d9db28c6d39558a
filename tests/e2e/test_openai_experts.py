"""`model` as `<base>:<expert>` on reception's OpenAI routes, against a real stack on the tiny model
with one signed expert installed (`expertctl expert install`): /v1/models lists it, a chat with it
forces that expert, and an expert the router has not registered is a 404 naming `model`."""

from __future__ import annotations

import time

import openai
import pytest

from libs.expertctl.main import main as expertctl
from libs.stack import LocalStack
from tests.e2e.conftest import openai_client, ready_tiny_stack
from tests.helpers.experts import Publisher
from tests.helpers.peft_adapters import write_lora_adapter

EXPERT = "json-parser"
MESSAGES = [{"role": "user", "content": "What colour are flamingos?"}]  # no reason to pick it


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory) -> LocalStack:
    root = tmp_path_factory.mktemp("openai-experts")
    publisher = Publisher.create(root)
    package = publisher.pack(
        write_lora_adapter(tiny_llama, root / "peft", seed=0), tiny_llama, root / f"{EXPERT}.expert", EXPERT
    )
    settings = {"EXPERT_STORE": str(root / "store"), "EXPERT_TRUSTED_KEYS": str(publisher.trusted)}
    with ready_tiny_stack(tiny_llama, root, **settings) as stack:
        args = ["expert", "install", str(package), "--store", str(root / "store")]
        args += ["--trusted", str(publisher.trusted), "--model", str(tiny_llama)]
        assert expertctl([*args, "--router", stack.target("router")]) == 0, "installing the expert failed"
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    with openai_client(stack) as client:
        yield client


def test_models_lists_the_base_model_then_base_colon_expert(client, tiny_llama):
    expected = [tiny_llama.name, f"{tiny_llama.name}:{EXPERT}"]
    deadline = time.monotonic() + 10  # the list is reused for 2 s
    while (ids := [m.id for m in client.models.list().data]) != expected:
        assert time.monotonic() < deadline, ids
        time.sleep(0.5)


def test_an_expert_in_the_model_name_is_forced(client, tiny_llama):
    model = f"{tiny_llama.name}:{EXPERT}"
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0.0)
    assert response.model == model and response.choices[0].finish_reason in ("stop", "length")
    assert EXPERT in response.model_extra["expert_system"]["experts"]
    plain = client.chat.completions.create(
        model=tiny_llama.name, messages=MESSAGES, max_tokens=4, temperature=0.0
    )
    assert plain.model_extra["expert_system"]["experts"] == []  # the prompt alone does not pick it


def test_a_stream_with_an_expert_in_the_model_name_reports_it(client, tiny_llama):
    model = f"{tiny_llama.name}:{EXPERT}"
    chunks = list(
        client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0.0, stream=True)
    )
    last = next(c for c in reversed(chunks) if c.model_extra.get("expert_system"))
    assert EXPERT in last.model_extra["expert_system"]["experts"]


def test_an_unregistered_expert_in_the_model_name_is_not_found_naming_model(client, tiny_llama):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=f"{tiny_llama.name}:no-such-expert", messages=MESSAGES)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    assert "no-such-expert" in caught.value.body["message"]
