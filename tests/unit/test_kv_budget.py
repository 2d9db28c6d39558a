"""Preparation's KV estimate for a job with n choices: the prompt's full blocks count once (the
engine's forks share them), everything after them once per choice."""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2
from services.preparation.fleet import kv_blocks_needed, kv_bytes

MODEL = common_pb2.ModelSpec(block_size=16, max_model_len=1024)


def _plan(prompt_bytes: int, max_tokens: int, n: int = 0) -> common_pb2.ExpertPlan:
    return common_pb2.ExpertPlan(
        prompt_bytes=prompt_bytes, generation_params=common_pb2.GenerationParams(max_tokens=max_tokens, n=n)
    )


def test_one_choice_is_prompt_plus_output():
    assert kv_blocks_needed(_plan(40, 24), MODEL) == 4  # 64 tokens
    assert kv_blocks_needed(_plan(40, 24, n=1), MODEL) == 4


def test_more_choices_share_the_prompts_full_blocks():
    # 40 prompt tokens: 2 full blocks shared; each choice has the partial block and 24 tokens (2 blocks).
    assert kv_blocks_needed(_plan(40, 24, n=3), MODEL) == 2 + 3 * 2
    # Capped by the context window per choice.
    assert kv_blocks_needed(_plan(1000, 500, n=2), MODEL) == 62 + 2 * (64 - 62)


def test_kv_bytes_use_the_engines_bytes_per_block():
    # An int8 cache: 12,240 bytes per token (codes and scales) on the default model, not 4 x 11,520.
    int8 = common_pb2.ModelSpec(
        num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=16, kv_bytes_per_block=195840
    )
    assert kv_bytes(10, int8) == 10 * 16 * 12240
    # An engine that reports no bytes per block: the float formula.
    older = common_pb2.ModelSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=16)
    assert kv_bytes(10, older) == 10 * 16 * 2 * 30 * 3 * 64 * 4
