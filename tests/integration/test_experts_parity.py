"""Experts in our engine against `peft` (the external reference): a LoRA (rank 8 on every projection,
non-zero B), an IA³ adapter and a soft prompt, each created with peft, packed and signed with our CLI
and loaded into the engine, give peft's greedy tokens; two LoRAs weighted 0.7 / 0.3 on one request
give peft's add_weighted_adapter(..., combination_type="cat")."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.engine import LLMEngine, SamplingParams
from tests.helpers.experts import Publisher, peft_greedy, peft_model
from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter, write_prompt_tuning_adapter

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
KINDS = ("lora", "ia3", "soft_prompt")


def _adapters(base: Path, root: Path, publisher: Publisher) -> dict[str, tuple[Path, Path]]:
    """name -> (peft directory, signed package) for one adapter of each kind and a second LoRA."""
    peft_dirs = {
        "lora": write_lora_adapter(base, root / "lora", seed=1),
        "lora-b": write_lora_adapter(base, root / "lora-b", r=4, lora_alpha=8, seed=2),
        "ia3": write_ia3_adapter(base, root / "ia3", seed=3),
        "soft-prompt": write_prompt_tuning_adapter(base, root / "soft-prompt", num_virtual_tokens=6, seed=4),
    }
    return {
        name: (d, publisher.pack(d, base, root / f"{name}.expert", name)) for name, d in peft_dirs.items()
    }


def _engine(base: Path, adapters, publisher: Publisher, **settings) -> LLMEngine:
    engine = LLMEngine.from_pretrained(str(base), **settings)
    for _, package in adapters.values():
        engine.load_expert(package, publisher.trusted)
    return engine


def _check_each_kind(engine: LLMEngine, base: Path, adapters, prompt: list[int]) -> None:
    for name in ("lora", "ia3", "soft-prompt"):
        expected = peft_greedy(peft_model(base, {name: adapters[name][0]}), prompt, NEW_TOKENS)
        out = engine.generate([prompt], GREEDY, experts=[(name, 1.0)])[0]
        assert out.token_ids == expected, name
        assert [(e.name, e.weight) for e in out.experts] == [(name, 1.0)]


def _check_weighted_loras(engine: LLMEngine, base: Path, adapters, prompt: list[int]) -> None:
    model = peft_model(base, {"a": adapters["lora"][0], "b": adapters["lora-b"][0]})
    model.add_weighted_adapter(["a", "b"], [0.7, 0.3], "mix", combination_type="cat")
    model.set_adapter("mix")
    expected = peft_greedy(model, prompt, NEW_TOKENS)
    out = engine.generate([prompt], GREEDY, experts=[("lora", 0.7), ("lora-b", 0.3)])[0]
    assert out.token_ids == expected


@pytest.fixture(scope="module")
def publisher(tmp_path_factory) -> Publisher:
    return Publisher.create(tmp_path_factory.mktemp("publisher"))


@pytest.fixture(scope="module")
def tiny_adapters(tiny_llama, tmp_path_factory, publisher):
    return _adapters(tiny_llama, tmp_path_factory.mktemp("tiny-adapters"), publisher)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_each_adapter_kind_matches_peft_on_a_tiny_model(tiny_llama, tiny_adapters, publisher, kernels):
    engine = _engine(tiny_llama, tiny_adapters, publisher, kernels=kernels, max_model_len=256, num_blocks=64)
    _check_each_kind(engine, tiny_llama, tiny_adapters, [5, 6, 7, 8, 9, 10, 11])


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_two_weighted_loras_match_peft_cat_on_a_tiny_model(tiny_llama, tiny_adapters, publisher, kernels):
    engine = _engine(tiny_llama, tiny_adapters, publisher, kernels=kernels, max_model_len=256, num_blocks=64)
    _check_weighted_loras(engine, tiny_llama, tiny_adapters, [12, 13, 14, 15])


@pytest.mark.default_model
def test_adapters_match_peft_on_the_default_model(default_model, tmp_path_factory, publisher):
    adapters = _adapters(default_model, tmp_path_factory.mktemp("default-adapters"), publisher)
    engine = _engine(default_model, adapters, publisher, max_model_len=512, num_blocks=64)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea."}])
    _check_each_kind(engine, default_model, adapters, prompt)
    _check_weighted_loras(engine, default_model, adapters, prompt)
