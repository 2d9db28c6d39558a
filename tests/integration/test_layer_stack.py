"""The native operator set's one-call layer loop (kernels/csrc/layers.cpp) against the model's
Python loop: the same kernels in the same order, so every logit must be the same bits."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from libs.engine.kernels.build import load
from tests.helpers.reference import capture_logits
from tests.helpers.tiny_checkpoint import ARCHITECTURES, write_checkpoint

pytestmark = pytest.mark.skipif(not load(), reason="native kernels did not build on this machine")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7] * n for n in (1, 4, 13)]  # together: prefill chunks and decodes in a step


def _run(model, quantization: str | None, loop: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = LLMEngine.from_pretrained(str(model), num_blocks=32, kernels="native", quantization=quantization)
    if loop:
        engine.model.layer_stack = None  # what a step with experts runs
    logits = capture_logits(engine)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)], logits


@pytest.mark.parametrize("architecture", ARCHITECTURES)  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_one_call_equals_the_python_loop(tmp_path, architecture, quantization):
    model = write_checkpoint(tmp_path / architecture, architecture, seed=3)
    engine = LLMEngine.from_pretrained(str(model), num_blocks=8, kernels="native")
    assert engine.model.layer_stack is not None  # the one-call path is what runs by default
    tokens, logits = _run(model, quantization, loop=False)
    loop_tokens, loop_logits = _run(model, quantization, loop=True)
    assert tokens == loop_tokens
    assert len(logits) == len(loop_logits) > 1
    for a, b in zip(logits, loop_logits, strict=True):
        assert torch.equal(a, b)


def test_the_torch_operator_set_runs_the_loop(tmp_path):
    model = write_checkpoint(tmp_path / "llama", seed=3)
    engine = LLMEngine.from_pretrained(str(model), num_blocks=8, kernels="torch")
    assert engine.model.layer_stack is None
