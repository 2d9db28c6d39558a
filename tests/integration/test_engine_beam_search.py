"""Beam search and best_of on the default model: the engine's beams equal transformers'
`generate(num_beams=4)` (the external reference, loaded once), with its default scoring and with
other length penalties and early stopping; beams share batches with ordinary requests and give
the same outputs as alone; best_of returns the most likely of its samples."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from tests.helpers.reference import load_hf

pytestmark = pytest.mark.default_model

BEAMS = 4
NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at",
    "In 1492,",
    "The quick brown fox",
    "Machine learning is",
]
# Chat prompts whose answers end within the budget: hypotheses that end in the end token.
CHATS = [
    [{"role": "user", "content": "Reply with one word: is the sky blue?"}],
    [{"role": "user", "content": "Say hello."}],
]


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine.from_pretrained(str(default_model), num_blocks=256, max_model_len=512, max_num_seqs=32)


@pytest.fixture(scope="module")
def hf_model(default_model):
    return load_hf(default_model)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(p) for p in PROMPTS] + [tok.encode_chat(c) for c in CHATS]


def _beams(**kw) -> SamplingParams:
    return SamplingParams(n=BEAMS, use_beam_search=True, temperature=0.0, max_tokens=NEW_TOKENS, **kw)


@torch.inference_mode()
def _hf_beams(model, prompt: list[int], eos: int, **kw) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search: the 4 hypotheses (up to and with their end token) and scores.
    On one thread: its small matmuls gain nothing from two, and on a busy machine two threads
    spinning for each other made a 12-token search take minutes instead of seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = _hf_generate(model, prompt, **kw)
    finally:
        torch.set_num_threads(threads)
    hypotheses = []
    for row in out.sequences[:, len(prompt) :].tolist():
        hypotheses.append(row[: row.index(eos) + 1] if eos in row else row)
    return hypotheses, out.sequences_scores.tolist()


def _hf_generate(model, prompt: list[int], **kw):
    return model.generate(
        torch.tensor([prompt]),
        num_beams=BEAMS,
        num_return_sequences=BEAMS,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        temperature=None,
        top_p=None,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return engine.generate(prompts, _beams())


def test_beam_search_equals_transformers_num_beams_4(engine, hf_model, prompts, alone):
    eos = engine.model_config.raw["eos_token_id"]
    for prompt, out in zip(prompts, alone, strict=True):
        expected, scores = _hf_beams(hf_model, prompt, eos)
        assert [c.token_ids for c in out.outputs] == expected, engine.tokenizer.decode(prompt)
        lengths = [len(c.token_ids) for c in out.outputs]
        ours = [c.cumulative_logprob / n for c, n in zip(out.outputs, lengths, strict=True)]
        assert ours == pytest.approx(scores, abs=1e-3)
    ended = [c for out in alone for c in out.outputs if c.finish_reason == "stop"]
    assert ended and all(c.token_ids[-1] == eos and c.text for c in ended)  # the chats end


@pytest.mark.parametrize(
    "scoring",
    [{"length_penalty": 0.5, "early_stopping": True}, {"length_penalty": 2.0, "early_stopping": "never"}],
)
def test_length_penalty_and_early_stopping_behave_as_transformers(engine, hf_model, prompts, scoring):
    eos = engine.model_config.raw["eos_token_id"]
    chosen = [prompts[1], prompts[-1]]
    outs = engine.generate(chosen, _beams(**scoring))
    for prompt, out in zip(chosen, outs, strict=True):
        expected, _ = _hf_beams(hf_model, prompt, eos, **scoring)
        assert [c.token_ids for c in out.outputs] == expected


def test_beams_mixed_with_ordinary_requests_equal_their_outputs_alone(engine, prompts, alone):
    ordinary = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=1.0, seed=9, n=1, best_of=3, max_tokens=NEW_TOKENS),
    ]
    by_itself = [engine.generate([prompts[0]], p)[0] for p in ordinary]
    mixed = engine.generate(
        [prompts[2], prompts[0], prompts[3], prompts[0], prompts[0]],
        [_beams(), ordinary[0], _beams(), ordinary[1], ordinary[2]],
    )
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in alone[2].outputs]
    assert [c.token_ids for c in mixed[2].outputs] == [c.token_ids for c in alone[3].outputs]
    for out, single in zip([mixed[1], mixed[3], mixed[4]], by_itself, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in single.outputs]


def test_best_of_returns_the_n_most_likely_of_its_samples(engine, prompts):
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 8}
    every = engine.generate([prompts[1]], SamplingParams(n=4, logprobs=0, **params))[0].outputs
    best = engine.generate([prompts[1]], SamplingParams(n=2, best_of=4, **params))[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked])
    assert best[0].logprobs is None  # ranked by log-prob without returning them
