"""The GPU's operator set end to end, on the CPU under Triton's interpreter: an engine with
kernels="triton" (paged attention, the fused norm / rotary / activation kernels) and decode steps
padded to the captured sizes gives, in float32, the greedy tokens of the native CPU kernels, for a
Llama, a Qwen2 (q/k/v biases) and a Qwen3 (QK norm); in bfloat16 it follows transformers as closely
as the torch operators do; and Llama-3-8B's layout (head dim 128, four query heads per KV head,
Llama 3 rotary scaling, a separate LM head) runs in bfloat16 and float16. On a GPU machine the same
tests run the compiled kernels and capture real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from tests.helpers.reference import hf_greedy, load_hf

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 137))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(checkpoint, **settings) -> LLMEngine:
    return LLMEngine.from_pretrained(str(checkpoint), max_model_len=256, num_blocks=64, **settings)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_the_triton_kernels_give_the_native_kernels_tokens_in_float32(tiny_checkpoints, architecture):
    checkpoint = tiny_checkpoints[architecture]
    triton = _engine(checkpoint, kernels="triton", cuda_graphs="on")
    assert triton.kernels == "triton" and triton.runner.graphs is not None
    expected = [
        o.token_ids for o in _engine(checkpoint, kernels="native", device="cpu").generate(PROMPTS, GREEDY)
    ]
    assert [o.token_ids for o in triton.generate(PROMPTS, GREEDY)] == expected


def test_the_triton_kernels_in_bfloat16_agree_with_transformers(tiny_llama):
    engine = _engine(tiny_llama, kernels="triton", cuda_graphs="on", dtype="bfloat16")
    model = load_hf(tiny_llama, torch.bfloat16)
    ours = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    reference = [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    agreeing = sum(a == b for a, b in zip(ours, reference, strict=True))
    # The torch operators agree on the same two of the three here: the long prompt's tokens part at
    # a near-tie that bfloat16 rounding decides.
    assert agreeing >= len(PROMPTS) - 1, (ours, reference)


@pytest.fixture(scope="module")
def llama3_layout(tmp_path_factory):
    from tests.helpers.tiny_checkpoint import write_checkpoint

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return write_checkpoint(
        tmp_path_factory.mktemp("llama3") / "llama3",
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=384,
        rope_parameters=llama3_rope,
        init_std=0.05,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_the_llama3_8b_layout_runs_in_half_precision(llama3_layout, dtype):
    engine = _engine(llama3_layout, kernels="triton", cuda_graphs="on", dtype=dtype)
    model = load_hf(llama3_layout, dtype)
    ours = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    reference = [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= len(PROMPTS) - 1, (ours, reference)
