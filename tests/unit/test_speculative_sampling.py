"""The rejection rule for model drafts, on fixed distributions: whatever q the drafter has, the
tokens it yields follow p (a drafted token the format refuses counts as rejected), and its draws
are a function of (seed, position) only."""

from __future__ import annotations

import torch

from libs.engine.sampler import SamplingBatch
from libs.engine.speculative_sampling import DRAFT_STREAM, RejectionRows, distribution, draw, stream_uniform

N = 20_000  # rows, one seed each
# Below this p-value the goodness-of-fit test fails: with these fixed seeds a correct rule passes;
# over seed choices a correct rule fails in 1 of 1,000 runs per test.
ALPHA = 0.001


def _batch(n: int, step: int = 3) -> SamplingBatch:
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    return SamplingBatch(
        temperature=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        seed_lo=seeds & 0xFFFFFFFF,
        seed_hi=torch.zeros(n, dtype=torch.int64),
        step=torch.full((n,), step, dtype=torch.int64),
    )


def _p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat.double() / 2))


def _verify(p: torch.Tensor, q: torch.Tensor, refused: torch.Tensor | None = None) -> torch.Tensor:
    """Draft x ~ q per row, then the rule: the token each row ends with."""
    batch = _batch(N)
    qs = q.expand(N, -1)
    drafted = draw(qs, stream_uniform(batch, DRAFT_STREAM))
    if refused is not None:
        drafted = torch.where(refused[drafted], -1, drafted)
    ordinary = torch.full((N,), -7, dtype=torch.int64)  # never kept: every row is listed
    rows = RejectionRows(torch.arange(N), drafted, qs.clone())
    return rows.apply(p.expand(N, -1), ordinary, batch)


def test_the_rule_yields_p_whatever_q_is():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    for q in (
        torch.tensor([0.1, 0.1, 0.3, 0.3, 0.1, 0.1]),  # far from p, mass where p has none
        torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05, 0.0]),  # near p
        p.clone(),  # equal: nothing is rejected
    ):
        tokens = _verify(p, q)
        assert bool((tokens >= 0).all())
        counts = torch.bincount(tokens, minlength=6).double()
        assert counts[5] == 0
        assert _p_value(counts, p.double()) > ALPHA, (q, counts)


def test_a_draft_the_format_refuses_is_a_rejection():
    """p is 0 on the refused tokens (the format's mask); q is not. Resampling such a position from
    max(0, p - q) keeps the output at p; drawing it from p would not."""
    p = torch.tensor([0.0, 0.6, 0.3, 0.1, 0.0])
    q = torch.tensor([0.4, 0.1, 0.3, 0.05, 0.15])
    refused = p == 0
    tokens = _verify(p, q, refused)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[refused].sum() == 0
    assert _p_value(counts, p.double()) > ALPHA, counts


def test_draws_depend_on_seed_and_position_only():
    p = torch.tensor([0.3, 0.3, 0.4])
    q = torch.tensor([0.6, 0.2, 0.2])
    batch = _batch(64)
    rows = RejectionRows(torch.arange(64), torch.zeros(64, dtype=torch.int64), q.expand(64, -1).clone())
    first = rows.apply(p.expand(64, -1), torch.zeros(64, dtype=torch.int64), batch)
    # The same rows in reverse order, inside a larger batch: each row's token is unchanged.
    big = _batch(64)
    for name in ("seed_lo", "seed_hi", "step"):
        setattr(big, name, getattr(batch, name).flip(0))
    again = rows.apply(p.expand(64, -1), torch.zeros(64, dtype=torch.int64), big)
    assert torch.equal(again.flip(0), first)
    assert 0 < int((first == 0).sum()) < 64  # some drafts kept, some resampled


def test_distribution_filters_and_normalises_like_the_sampler():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.0]])
    batch = _batch(2)
    batch.temperature = torch.tensor([1.0, 0.0])
    batch.top_k = torch.tensor([2, 0])
    batch.any_top_k, batch.max_top_k = True, 2
    q = distribution(logits, batch)
    assert torch.allclose(q[0], torch.tensor([1, torch.e**-1, 0, 0]) / (1 + torch.e**-1))
    assert torch.equal(q[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # temperature 0: the argmax
