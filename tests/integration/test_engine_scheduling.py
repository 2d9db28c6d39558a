"""Continuous batching on a tiny real model: batch invariance, chunked prefill, prefix caching,
preemption, abort and copy-on-write forks all leave every request's tokens exactly as they are alone."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from libs.engine.sequence import derive_seed

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=1234)


def _prompts(engine: LLMEngine, count: int, seed: int = 0, length: int | None = None) -> list[list[int]]:
    """Random token prompts, of random lengths in [1, 60) unless `length` is given."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    lengths = [length or int(torch.randint(1, 60, (1,), generator=g)) for _ in range(count)]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=400)


def _alone(engine: LLMEngine, prompts, params) -> list[list[int]]:
    return [engine.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_sixteen_prompts_together_give_the_tokens_each_gives_alone(engine, params):
    prompts = _prompts(engine, 16)
    together = [out.token_ids for out in engine.generate(prompts, params)]
    assert together == _alone(engine, prompts, params)
    assert len({tuple(t) for t in together}) > 1


def test_default_model_is_batch_invariant(default_model):
    engine = LLMEngine.from_pretrained(str(default_model), max_model_len=512, num_blocks=200)
    texts = [
        "Once upon a time",
        "The recipe needs",
        "import numpy as np\n",
        "Paris is",
        "1, 2, 3,",
        "Dear customer,",
        "The weather today",
        "In 1492",
        "SELECT * FROM",
        "A haiku about rain:",
        "To be or not",
        "The mitochondria",
        "Q: What is 2+2?\nA:",
        "My favourite food",
        "Chapter 1",
        "The best way to learn",
    ]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [out.token_ids for out in engine.generate(prompts, params)]
    assert together == _alone(engine, prompts, params)


def test_chunked_prefill_matches_a_single_prefill(tiny_llama, engine):
    chunked = LLMEngine.from_pretrained(
        str(tiny_llama),
        max_model_len=512,
        num_blocks=400,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    prompt = _prompts(engine, 1, seed=5, length=300)[0]
    expected = engine.generate([prompt], GREEDY)[0].token_ids
    steps_before = chunked.get_stats().num_steps_total
    assert chunked.generate([prompt], GREEDY)[0].token_ids == expected
    prefill_steps = chunked.get_stats().num_steps_total - steps_before - (GREEDY.max_tokens - 1)
    assert prefill_steps == -(-len(prompt) // 32)


def test_a_long_prompt_never_stalls_running_decodes(tiny_llama):
    engine = LLMEngine.from_pretrained(
        str(tiny_llama), max_model_len=512, num_blocks=400, max_num_batched_tokens=16, max_num_seqs=4
    )
    engine.add_request("decoding", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # its prefill
    engine.add_request(
        "long", list(range(3, 203)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    for _ in range(10):  # the 200-token prompt needs 13+ steps at 15 tokens per step
        produced = {out.request_id for out in engine.step()}
        assert "decoding" in produced
    assert engine.scheduler.running[-1].num_computed_tokens < 200


def test_shared_prefix_hits_the_cache_and_changes_nothing(tiny_llama, engine):
    cold = LLMEngine.from_pretrained(
        str(tiny_llama), max_model_len=512, num_blocks=400, enable_prefix_caching=False
    )
    prefix = _prompts(engine, 1, seed=9, length=64)[0]
    first, second = [*prefix, 11, 12, 13], [*prefix, 21, 22]
    warm = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=400)
    warm.generate([first], GREEDY)
    before = warm.get_stats()
    out = warm.generate([second], GREEDY)[0]
    after = warm.get_stats()
    assert out.metrics.num_cached_tokens == 64
    assert after.prompt_tokens_total - before.prompt_tokens_total == len(second) - 64
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    assert out.token_ids == cold.generate([second], GREEDY)[0].token_ids


def test_preemption_under_a_tiny_pool_keeps_every_output(tiny_llama, engine):
    prompts = _prompts(engine, 8, seed=3)
    params = SamplingParams(temperature=0.7, seed=99, max_tokens=40, ignore_eos=True)
    expected = [out.token_ids for out in engine.generate(prompts, params)]
    small = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=128, num_blocks=14, block_size=16)
    got = [out.token_ids for out in small.generate(prompts, params)]
    assert small.get_stats().num_preemptions_total > 0
    assert got == expected
    assert small.get_stats().kv_used_blocks == 0


def test_abort_returns_the_pool_to_full(engine):
    total = engine.get_stats().kv_num_blocks
    for i, prompt in enumerate(_prompts(engine, 6, seed=4)):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(max_tokens=100, ignore_eos=True, n=2))
    for _ in range(5):
        engine.step()
    assert engine.get_stats().kv_used_blocks > 0
    engine.abort_request([f"abort-{i}" for i in range(6)])
    finals = engine.step()
    assert {o.request_id for o in finals} == {f"abort-{i}" for i in range(6)}
    assert all(c.finish_reason == "abort" for o in finals for c in o.outputs)
    stats = engine.get_stats()
    assert stats.kv_used_blocks == stats.kv_session_blocks == 0
    assert stats.kv_free_blocks + stats.kv_cached_blocks == total  # published prompt blocks stay cached
    assert not engine.has_unfinished_requests()


def test_n_outputs_fork_with_copy_on_write(engine):
    prompt = _prompts(engine, 1, seed=8, length=21)[0]  # ends mid-block: the forks share a partial block
    params = SamplingParams(n=4, temperature=1.0, seed=2024, max_tokens=30, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    for c in out.outputs:
        seed = params.seed if c.index == 0 else derive_seed(params.seed, c.index)
        single = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True)
        assert engine.generate([prompt], single)[0].token_ids == c.token_ids
    assert engine.get_stats().kv_used_blocks == 0


def _record_decode_shapes(engine: LLMEngine) -> list[tuple[int, int]]:
    """(rows, block-table width) of every decode-only forward the engine runs."""
    seen: list[tuple[int, int]] = []
    forward = engine.model.forward

    def recording(input_ids, positions, meta, kv_caches, adapters=None):
        if meta.max_query_len == 1:
            seen.append((input_ids.shape[0], meta.block_tables.shape[1]))
        return forward(input_ids, positions, meta, kv_caches, adapters)

    engine.model.forward = recording
    return seen


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_graph_steps_pad_decode_batches_to_captured_sizes(tiny_llama, engine, kernels):
    from libs.engine.cuda_graphs import DECODE_SIZES

    padded = LLMEngine.from_pretrained(
        str(tiny_llama), max_model_len=512, num_blocks=400, cuda_graphs="on", kernels=kernels
    )
    seen = _record_decode_shapes(padded)
    outs = padded.generate(_prompts(engine, 5, seed=12), SEEDED)
    assert all(len(o.token_ids) == SEEDED.max_tokens for o in outs)
    assert seen and all(rows in DECODE_SIZES for rows, _ in seen)
    assert {rows for rows, _ in seen} >= {8}  # five sequences decode as a batch of eight
    assert {width for _, width in seen} == {512 // 16}
    assert padded.get_stats().kv_used_blocks == 0


def test_padding_rows_change_no_output(tiny_llama, engine):
    # Exact with the native kernels, whose rows do not depend on the batch.
    padded = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=400, cuda_graphs="on")
    prompts = _prompts(engine, 5, seed=12)
    expected = [out.token_ids for out in engine.generate(prompts, SEEDED)]
    assert [out.token_ids for out in padded.generate(prompts, SEEDED)] == expected
