"""Several base models and `model` as `<base>:<expert>`, against a real stack serving two tiny
models (a Llama on its engine, a Qwen2 on a second engine) with one signed expert for the Llama
installed (`expertctl expert install`): /v1/models lists both models and the expert under the model
it fits, a job runs only on an engine of its model, the expert named in `model` is forced, and an
unknown model, an unregistered expert or one trained for the other model are refused at once."""

from __future__ import annotations

import time

import openai
import pytest

from expert_system import ExpertClient, InvalidRequest
from tests.e2e.conftest import openai_client, ready_tiny_stack
from tests.helpers.experts import Publisher
from tests.helpers.peft_adapters import write_lora_adapter
from tools.expertctl.main import main as expertctl
from tools.stack import LocalStack

EXPERT = "json-parser"
QWEN_ENGINE = "qwen-engine"
MESSAGES = [{"role": "user", "content": "What colour are flamingos?"}]  # no reason to pick it


@pytest.fixture(scope="module")
def stack(tiny_llama, tiny_checkpoints, tmp_path_factory) -> LocalStack:
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
        stack.start_engine(QWEN_ENGINE, env={"EXPERT_MODEL_PATH": str(tiny_checkpoints["qwen2"])})
        yield stack


@pytest.fixture(scope="module")
def sdk(stack) -> ExpertClient:
    with ExpertClient(stack.target("reception")) as client:
        yield client


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    with openai_client(stack) as client:
        yield client


def test_models_lists_both_models_then_the_expert_under_the_model_it_fits(
    client, tiny_llama, tiny_checkpoints
):
    # The Llama's engine registered first: it is the default model, listed first.
    expected = [tiny_llama.name, tiny_checkpoints["qwen2"].name, f"{tiny_llama.name}:{EXPERT}"]
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


def test_a_job_runs_on_an_engine_of_the_model_it_names_and_the_default_is_the_first(sdk, tiny_checkpoints):
    qwen = tiny_checkpoints["qwen2"].name
    for _ in range(3):
        result = sdk.infer(prompt="Hello", raw=True, max_tokens=4, temperature=0.0, model=qwen)
        assert result.status == "completed" and result.model == qwen
        assert f"preparation: engine {QWEN_ENGINE} " in result.reasoning_trace
    default = sdk.infer(prompt="Hello", raw=True, max_tokens=4, temperature=0.0)
    assert default.model != qwen and f"engine {QWEN_ENGINE} " not in default.reasoning_trace


def test_a_model_no_engine_serves_is_refused_at_once_on_both_fronts(client, sdk):
    started = time.monotonic()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    assert "no engine serves the model 'no-such-model'" in caught.value.body["message"]
    with pytest.raises(InvalidRequest) as refused:
        sdk.infer(prompt="Hello", model="no-such-model")
    assert refused.value.field_violations[0][0] == "request.model"
    assert time.monotonic() - started < 5  # refused at admission, never queued


def test_an_expert_of_the_other_model_is_refused_naming_model(client, tiny_checkpoints):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=f"{tiny_checkpoints['qwen2'].name}:{EXPERT}", messages=MESSAGES)
    assert caught.value.body["param"] == "model"
    assert "trained for another base model" in caught.value.body["message"]
