"""The GPU's operator set end to end, on the CPU under Triton's interpreter: an engine with
kernels="triton" (paged attention, the fused norm / rotary / activation kernels) and decode steps
padded to the captured sizes gives, in float32, the greedy tokens of the native CPU kernels, for a
Llama and a Qwen3 (QK norm); in bfloat16 it follows transformers as closely as the torch operators."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from tests.helpers.reference import hf_greedy, load_hf

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 137))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(checkpoint, **settings) -> LLMEngine:
    return LLMEngine.from_pretrained(str(checkpoint), max_model_len=256, num_blocks=64, **settings)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_the_triton_kernels_give_the_native_kernels_tokens_in_float32(tiny_checkpoints, architecture):
    checkpoint = tiny_checkpoints[architecture]
    triton = _engine(checkpoint, kernels="triton", cuda_graphs="on")
    assert triton.kernels == "triton" and triton.runner.graphs is not None
    expected = [o.token_ids for o in _engine(checkpoint, kernels="native").generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in triton.generate(PROMPTS, GREEDY)] == expected


def test_the_triton_kernels_in_bfloat16_agree_with_transformers(tiny_llama):
    engine = _engine(tiny_llama, kernels="triton", cuda_graphs="on", dtype="bfloat16")
    model = load_hf(tiny_llama, torch.bfloat16)
    ours = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    reference = [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    agreeing = sum(a == b for a, b in zip(ours, reference, strict=True))
    assert agreeing >= len(PROMPTS) - 1, (ours, reference)
