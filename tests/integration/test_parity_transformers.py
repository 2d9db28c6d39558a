"""Our engine against transformers (the external reference) on the same checkpoints: identical greedy
tokens for 64 new tokens, and last-position logits within 1e-3 after prefill and 16 decode steps."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from tests.helpers.reference import capture_logits, hf_greedy, load_hf

NEW_TOKENS = 64
LOGIT_STEPS = (0, 16)  # after prefill, after 16 decode steps
TOLERANCE = 1e-3


def _check(engine: LLMEngine, hf_model, prompt_ids: list[int]) -> None:
    captured = capture_logits(engine)
    out = engine.generate(
        [prompt_ids], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )[0]
    expected_tokens, expected_logits = hf_greedy(hf_model, prompt_ids, NEW_TOKENS)
    assert out.token_ids == expected_tokens
    assert len(captured) == NEW_TOKENS
    for step in LOGIT_STEPS:
        diff = (captured[step][0] - expected_logits[step]).abs().max().item()
        assert diff <= TOLERANCE, f"step {step}: max |logit difference| {diff}"


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_matches_transformers(tiny_checkpoints, architecture, kernels):
    path = tiny_checkpoints[architecture]
    engine = LLMEngine.from_pretrained(str(path), kernels=kernels, max_model_len=256, num_blocks=64)
    hf_model = load_hf(path)
    generator = torch.Generator().manual_seed(11)
    for length in (1, 7, 40):
        prompt = torch.randint(3, engine.model_config.vocab_size, (length,), generator=generator).tolist()
        _check(engine, hf_model, prompt)


@pytest.mark.default_model
def test_default_model_matches_transformers(default_model):
    engine = LLMEngine.from_pretrained(str(default_model), max_model_len=1024, num_blocks=256)
    hf_model = load_hf(default_model)
    tok = engine.tokenizer
    prompts = [
        tok.encode("The three primary colours are"),
        tok.encode("def fibonacci(n):\n    "),
        tok.encode_chat([{"role": "user", "content": "Name a famous painting and its painter."}]),
    ]
    assert tok.decode(prompts[2], skip_special_tokens=False).startswith("<|im_start|>system\n")
    for prompt in prompts:
        _check(engine, hf_model, prompt)
