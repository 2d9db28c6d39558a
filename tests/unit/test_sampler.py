"""The sampler on synthetic logits: greedy, each filter, temperature, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from libs.engine.sampler import Sampler, SamplingBatch, _apply_penalties

DRAWS = 2000


def _column(value, rows: int, dtype: torch.dtype) -> torch.Tensor:
    values = list(value) if isinstance(value, Sequence) else [value] * rows
    assert len(values) == rows
    return torch.tensor(values, dtype=dtype)


def _padded(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max(1, *(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


def make_batch(
    rows: int,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seed=0,
    step=0,
    repetition_penalty=None,
    presence_penalty=None,
    frequency_penalty=None,
    prompt_tokens: Sequence[Sequence[int]] | None = None,
    output_tokens: Sequence[Sequence[int]] | None = None,
    penalty_exempt: Sequence[Sequence[int]] | None = None,
    vocab_size: int | None = None,
    num_logprobs: int = -1,
) -> SamplingBatch:
    """A SamplingBatch as the runner builds it; each setting is one value for all rows or one per row."""
    temperature = _column(temperature, rows, torch.float32)
    top_k = _column(top_k, rows, torch.int64)
    top_p = _column(top_p, rows, torch.float32)
    min_p = _column(min_p, rows, torch.float32)
    seeds = list(seed) if isinstance(seed, Sequence) else [seed] * rows
    batch = SamplingBatch(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed_lo=torch.tensor([s & 0xFFFFFFFF for s in seeds], dtype=torch.int64),
        seed_hi=torch.tensor([s >> 32 for s in seeds], dtype=torch.int64),
        step=_column(step, rows, torch.int64),
        num_logprobs=num_logprobs,
        all_greedy=bool((temperature == 0).all()),
        any_top_k=bool((top_k > 0).any()),
        any_top_p=bool((top_p < 1).any()),
        any_min_p=bool((min_p > 0).any()),
        max_top_k=int(top_k.max()),
    )
    penalties = (repetition_penalty, presence_penalty, frequency_penalty, prompt_tokens, output_tokens)
    if any(p is not None for p in penalties):
        assert vocab_size is not None, "penalties need the vocabulary size (the token padding value)"
        batch.repetition_penalty = _column(
            1.0 if repetition_penalty is None else repetition_penalty, rows, torch.float32
        )
        batch.presence_penalty = _column(presence_penalty or 0.0, rows, torch.float32)
        batch.frequency_penalty = _column(frequency_penalty or 0.0, rows, torch.float32)
        batch.prompt_tokens = _padded(prompt_tokens or [[]] * rows, vocab_size)
        batch.output_tokens = _padded(output_tokens or [[]] * rows, vocab_size)
        if penalty_exempt is not None:
            batch.penalty_exempt = _padded(penalty_exempt, vocab_size)
    return batch


def draw(logits: Sequence[float], draws: int = DRAWS, **settings) -> list[int]:
    """One token per seed 0..draws-1 from the same logits row."""
    row = torch.tensor(logits, dtype=torch.float32)
    batch = make_batch(draws, seed=list(range(draws)), **settings)
    return Sampler()(row.expand(draws, -1).contiguous(), batch).token_ids.tolist()


def greedy_pick(logits: Sequence[float], **penalties) -> int:
    """The greedy token of one row after its penalties."""
    row = torch.tensor([logits], dtype=torch.float32)
    batch = make_batch(1, temperature=0.0, vocab_size=len(logits), **penalties)
    return int(Sampler()(row, batch).token_ids[0])


def entropy(tokens: list[int]) -> float:
    counts = Counter(tokens)
    return -sum(c / len(tokens) * math.log(c / len(tokens)) for c in counts.values())


def log_probs(probs: Sequence[float]) -> list[float]:
    return [math.log(p) for p in probs]


LOGITS = [0.3, 2.0, -1.0, 1.2, 0.0, 1.9, -0.5, 0.8]


# -- greedy and filters ---------------------------------------------------------------------------


def test_greedy_is_the_argmax_of_each_row():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, make_batch(16, temperature=0.0, seed=list(range(16))))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_a_greedy_row_in_a_sampled_batch_is_still_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, make_batch(4, temperature=[0.0, 1.0, 0.0, 1.5], seed=[1, 2, 3, 4]))
    assert out.token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()


def test_top_k_one_equals_greedy_at_any_temperature():
    assert set(draw(LOGITS, top_k=1, temperature=2.0)) == {1}


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_only_ever_samples_among_the_k_largest(k):
    allowed = set(sorted(range(len(LOGITS)), key=lambda i: -LOGITS[i])[:k])
    assert set(draw(LOGITS, top_k=k, temperature=2.0)) == allowed


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    assert set(draw(LOGITS, top_k=1000, temperature=2.0)) == set(range(len(LOGITS)))


# probabilities 0.45, 0.25, 0.15, 0.10, 0.05: cumulative 0.45, 0.70, 0.85, 0.95, 1.0
TOP_P_PROBS = [0.45, 0.25, 0.15, 0.10, 0.05]


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.3, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (0.9, {0, 1, 2, 3}), (0.99, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(top_p, allowed):
    assert set(draw(log_probs(TOP_P_PROBS), top_p=top_p)) == allowed


def test_top_p_is_applied_after_top_k():
    # top_k=3 renormalises to 0.529, 0.294, 0.176; top_p 0.8 then keeps the first two
    assert set(draw(log_probs(TOP_P_PROBS), top_k=3, top_p=0.8)) == {0, 1}


@pytest.mark.parametrize(
    ("min_p", "allowed"),
    # threshold = min_p * 0.45: 0.0225, 0.09, 0.135, 0.1575, 0.27
    [(0.05, {0, 1, 2, 3, 4}), (0.2, {0, 1, 2, 3}), (0.3, {0, 1, 2}), (0.35, {0, 1}), (0.6, {0})],
)
def test_min_p_removes_tokens_below_min_p_times_the_top_probability(min_p, allowed):
    assert set(draw(log_probs(TOP_P_PROBS), min_p=min_p)) == allowed


def test_min_p_one_keeps_only_the_most_likely_token():
    assert set(draw(LOGITS, min_p=1.0)) == {1}


# -- temperature and the sampled distribution -----------------------------------------------------


def test_lower_temperature_concentrates_the_samples():
    entropies = [entropy(draw(LOGITS, temperature=t)) for t in (0.25, 0.5, 1.0, 2.0)]
    assert entropies == sorted(entropies)
    assert entropies[0] < 0.8 * entropies[-1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_sample_frequencies_match_softmax_of_logits_over_temperature(temperature):
    draws = 8000
    tokens = draw(LOGITS, draws=draws, temperature=temperature)
    expected = torch.tensor(LOGITS).div(temperature).softmax(-1).tolist()
    counts = Counter(tokens)
    for token, p in enumerate(expected):
        # 4.5 standard deviations of a binomial frequency (at most 0.0056 here); fixed seeds, no flakes
        assert abs(counts[token] / draws - p) < 4.5 * math.sqrt(p * (1 - p) / draws) + 1e-3, token


def test_frequencies_over_the_steps_of_one_seed_match_the_softmax_too():
    draws = 8000
    row = torch.tensor(LOGITS).expand(draws, -1).contiguous()
    batch = make_batch(draws, seed=12345, step=list(range(draws)))
    counts = Counter(Sampler()(row, batch).token_ids.tolist())
    for token, p in enumerate(torch.tensor(LOGITS).softmax(-1).tolist()):
        assert abs(counts[token] / draws - p) < 4.5 * math.sqrt(p * (1 - p) / draws) + 1e-3, token


# -- penalties ------------------------------------------------------------------------------------


def test_repetition_penalty_divides_a_positive_logit_of_a_seen_token():
    # token 0: 3.0 / 2 = 1.5, between its rival's 1.4 and 1.6
    assert greedy_pick([3.0, 1.6], repetition_penalty=2.0, prompt_tokens=[[0]]) == 1
    assert greedy_pick([3.0, 1.4], repetition_penalty=2.0, prompt_tokens=[[0]]) == 0


def test_repetition_penalty_multiplies_a_negative_logit_of_a_seen_token():
    # token 0: -1.0 * 2 = -2.0, between its rival's -1.9 and -2.1
    assert greedy_pick([-1.0, -1.9], repetition_penalty=2.0, output_tokens=[[0]]) == 1
    assert greedy_pick([-1.0, -2.1], repetition_penalty=2.0, output_tokens=[[0]]) == 0


def test_repetition_penalty_below_one_boosts_a_seen_token():
    # 1.0 / 0.5 = 2.0
    assert greedy_pick([1.0, 1.9], repetition_penalty=0.5, prompt_tokens=[[0]]) == 0
    assert greedy_pick([1.0, 2.1], repetition_penalty=0.5, prompt_tokens=[[0]]) == 1


def test_repetition_penalty_leaves_unseen_tokens_alone():
    assert greedy_pick([3.0, 2.9, 0.0], repetition_penalty=2.0, prompt_tokens=[[2]], output_tokens=[[2]]) == 0


def test_repetition_penalty_applies_once_however_often_a_token_was_seen():
    seen = {"prompt_tokens": [[0, 0, 0]], "output_tokens": [[0, 0]]}
    assert greedy_pick([3.0, 1.4], repetition_penalty=2.0, **seen) == 0
    assert greedy_pick([3.0, 1.6], repetition_penalty=2.0, **seen) == 1


def test_presence_penalty_subtracts_once_for_any_output_occurrence():
    # 2.0 - 0.5 = 1.5, whether the token came out once or three times
    for occurrences in (1, 3):
        output = [[0] * occurrences]
        assert greedy_pick([2.0, 1.4], presence_penalty=0.5, output_tokens=output) == 0
        assert greedy_pick([2.0, 1.6], presence_penalty=0.5, output_tokens=output) == 1


def test_frequency_penalty_subtracts_per_output_occurrence():
    # 2.0 - 3 * 0.3 = 1.1
    assert greedy_pick([2.0, 1.0], frequency_penalty=0.3, output_tokens=[[0, 0, 0]]) == 0
    assert greedy_pick([2.0, 1.2], frequency_penalty=0.3, output_tokens=[[0, 0, 0]]) == 1


def test_presence_and_frequency_penalties_add_up():
    # 2.0 - 0.5 - 3 * 0.2 = 0.9
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.2, "output_tokens": [[0, 1, 0, 0]]}
    assert greedy_pick([2.0, -5.0, 0.85], **penalties) == 0
    assert greedy_pick([2.0, -5.0, 0.95], **penalties) == 2


def test_negative_presence_and_frequency_penalties_reward_repetition():
    assert greedy_pick([1.0, 1.9], presence_penalty=-1.0, output_tokens=[[0]]) == 0
    assert greedy_pick([1.0, 1.9], frequency_penalty=-0.5, output_tokens=[[0, 0]]) == 0


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    prompt = [[0, 0, 0]]
    assert greedy_pick([2.0, 1.9], presence_penalty=2.0, frequency_penalty=2.0, prompt_tokens=prompt) == 0


def test_penalties_of_one_row_do_not_touch_another():
    logits = torch.tensor([[3.0, 1.6], [3.0, 1.6]])
    batch = make_batch(
        2, temperature=0.0, repetition_penalty=[2.0, 1.0], prompt_tokens=[[0], [0]], vocab_size=2
    )
    assert Sampler()(logits, batch).token_ids.tolist() == [1, 0]


EOS, IM_START, IM_END, STOP, WORD, UNSEEN = range(6)
# A chat history in which the end-of-turn, control and stop tokens occur many times, as in a
# multi-turn prompt (and in an output that went on past them).
HISTORY = [IM_START, WORD, IM_END, EOS, STOP, WORD] * 5
STRONG = {"repetition_penalty": 1.3, "presence_penalty": 1.0, "frequency_penalty": 1.0}


def test_penalties_leave_eos_stop_and_control_token_logits_unchanged():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.7, 3.0, 0.5]])
    batch = make_batch(
        1,
        prompt_tokens=[HISTORY],
        output_tokens=[HISTORY],
        penalty_exempt=[[EOS, IM_START, IM_END, STOP]],
        vocab_size=6,
        **STRONG,
    )
    out = _apply_penalties(logits, batch)
    for token in (EOS, IM_START, IM_END, STOP, UNSEEN):
        assert out[0, token] == logits[0, token]
    # the ordinary word, 10 times in the output: 3.0 / 1.3 - 10 * 1.0 - 1.0
    assert out[0, WORD] == pytest.approx(3.0 / 1.3 - 10 - 1)


def test_without_exempt_ids_every_seen_token_is_penalized_as_vllm_does():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.7, 3.0, 0.5]])
    batch = make_batch(1, prompt_tokens=[HISTORY], output_tokens=[HISTORY], vocab_size=6, **STRONG)
    out = _apply_penalties(logits, batch)
    assert out[0, EOS] == pytest.approx(2.0 / 1.3 - 5 - 1)
    assert out[0, IM_START] == pytest.approx(-1.0 * 1.3 - 5 - 1)
    assert out[0, UNSEEN] == logits[0, UNSEEN]


def test_exempt_ids_are_per_row():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.7, 3.0, 0.5]] * 2)
    batch = make_batch(
        2,
        prompt_tokens=[HISTORY] * 2,
        output_tokens=[HISTORY] * 2,
        penalty_exempt=[[EOS], [STOP]],
        vocab_size=6,
        **STRONG,
    )
    out = _apply_penalties(logits, batch)
    assert out[0, EOS] == logits[0, EOS] and out[0, STOP] < logits[0, STOP]
    assert out[1, STOP] == logits[1, STOP] and out[1, EOS] < logits[1, EOS]


def test_a_model_that_wants_to_stop_still_stops_under_strong_penalties():
    # EOS is the most likely token and has been seen 5 times: without the exemption the penalties
    # would hand the pick to the unseen token.
    logits = [2.0, -1.0, 1.5, 0.7, 0.0, 1.0]
    settings = {"prompt_tokens": [HISTORY], "output_tokens": [HISTORY], **STRONG}
    assert greedy_pick(logits, **settings) == UNSEEN
    assert greedy_pick(logits, penalty_exempt=[[EOS, IM_START, IM_END, STOP]], **settings) == EOS


# -- seeds ----------------------------------------------------------------------------------------

FLAT = [0.0] * 1000  # uniform: the token drawn is decided by the noise alone


def _sample_flat(seeds: list[int], steps: list[int]) -> list[int]:
    rows = len(seeds)
    logits = torch.zeros(rows, len(FLAT))
    return Sampler()(logits, make_batch(rows, seed=seeds, step=steps)).token_ids.tolist()


def test_same_seed_and_step_give_the_same_token():
    seeds, steps = list(range(100)), [s % 7 for s in range(100)]
    assert _sample_flat(seeds, steps) == _sample_flat(seeds, steps)


def test_different_steps_of_one_seed_draw_different_noise():
    tokens = _sample_flat([42] * 64, list(range(64)))
    assert len(set(tokens)) >= 55  # 64 uniform draws from 1000 tokens: about two repeats expected


def test_different_seeds_at_one_step_draw_different_noise():
    assert len(set(_sample_flat(list(range(64)), [0] * 64))) >= 55


def test_the_high_bits_of_the_seed_matter():
    lows = list(range(32))
    highs = [s + (1 << 32) * (s + 1) for s in lows]
    a, b = _sample_flat(lows, [0] * 32), _sample_flat(highs, [0] * 32)
    assert sum(x != y for x, y in zip(a, b, strict=True)) >= 28


def test_a_row_sample_does_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(3)
    vocab = 64
    logits = torch.randn(8, vocab, generator=g) * 2
    target = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    others = [
        {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0},
        {"temperature": 1.3, "top_k": 5, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0},
        {"temperature": 0.7, "top_k": 0, "top_p": 0.5, "min_p": 0.0, "repetition_penalty": 1.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.3, "repetition_penalty": 1.0},
        {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.7},
        {"temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 0.6},
        {"temperature": 0.0, "top_k": 10, "top_p": 0.2, "min_p": 0.0, "repetition_penalty": 1.2},
    ]
    history = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in range(8)]
    for seed in range(40):
        rows = [target, *others]
        columns = {key: [r[key] for r in rows] for key in target}
        common = {"vocab_size": vocab, "num_logprobs": 5}
        together = Sampler()(
            logits,
            make_batch(
                8,
                seed=[seed, *range(100, 107)],
                step=[seed % 5, *range(7)],
                prompt_tokens=history,
                output_tokens=history[::-1],
                **columns,
                **common,
            ),
        )
        alone = Sampler()(
            logits[:1],
            make_batch(1, seed=seed, step=seed % 5, temperature=0.9, **common),
        )
        assert together.token_ids[0] == alone.token_ids[0]
        assert together.sampled_logprobs[0] == alone.sampled_logprobs[0]
        assert torch.equal(together.top_token_ids[0], alone.top_token_ids[0])


# -- logprobs -------------------------------------------------------------------------------------


def test_no_logprobs_unless_asked():
    out = Sampler()(torch.randn(2, 10), make_batch(2))
    assert out.sampled_logprobs is None and out.top_logprobs is None and out.top_token_ids is None


def test_logprobs_zero_gives_only_the_sampled_token_logprob():
    out = Sampler()(torch.randn(2, 10), make_batch(2, num_logprobs=0))
    assert out.sampled_logprobs.shape == (2,)
    assert out.top_logprobs is None and out.top_token_ids is None


def test_sampled_logprob_is_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g) * 3
    batch = make_batch(
        6,
        temperature=[0.0, 0.5, 1.0, 1.5, 1.0, 0.8],
        top_k=[0, 0, 5, 0, 0, 2],
        top_p=[1.0, 0.9, 1.0, 1.0, 0.5, 1.0],
        seed=list(range(6)),
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        output_tokens=[[1, 2, 3]] * 6,
        vocab_size=40,
        num_logprobs=4,
    )
    out = Sampler()(logits, batch)
    expected = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs, expected, rtol=0, atol=1e-6)


def test_top_logprobs_are_the_n_largest_sorted_descending():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 40, generator=g)
    out = Sampler()(logits, make_batch(3, seed=[1, 2, 3], num_logprobs=7))
    reference = logits.log_softmax(-1)
    assert out.top_logprobs.shape == out.top_token_ids.shape == (3, 7)
    for row in range(3):
        values = out.top_logprobs[row].tolist()
        assert values == sorted(values, reverse=True)
        assert out.top_token_ids[row].tolist() == reference[row].argsort(descending=True)[:7].tolist()
        torch.testing.assert_close(out.top_logprobs[row], reference[row, out.top_token_ids[row]])


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.999])
def test_the_sync_free_sampler_draws_the_same_tokens(top_p):
    # The GPU's sampler sorts whole rows for top-p instead of asking the device whether 256
    # candidates held the nucleus: the same cut-offs, so the same tokens. A flat vocabulary of
    # 3,000 makes the nucleus of p = 0.999 reach far past the candidates.
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 3000, generator=g) * torch.linspace(0.1, 6.0, 24)[:, None]
    batch = make_batch(
        24,
        temperature=[0.0, 0.7, 1.0, 1.3] * 6,
        top_k=[0, 0, 50, 400] * 6,
        top_p=top_p,
        min_p=[0.0, 0.0, 0.0, 0.05] * 6,
        seed=list(range(24)),
    )
    expected = Sampler()(logits, batch).token_ids
    assert torch.equal(Sampler(sync_free=True)(logits, batch).token_ids, expected)
