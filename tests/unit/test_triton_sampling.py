"""Top-p's cut-off searched without a sort (kernels/triton/sampling.py), under Triton's interpreter:
the same cut-off as sorting the row and summing the mass before each token, ties included, and the
device sampler's tokens unchanged by it."""

from __future__ import annotations

import torch

from libs.engine.kernels.triton.sampling import top_p_cutoff
from libs.engine.sampler import Sampler
from tests.unit.test_sampler import make_batch


def _sorted_cutoff(probs: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """The reference: keep a token while the mass strictly before it (descending) is below wanted."""
    top = probs.sort(dim=-1, descending=True).values
    before = top.cumsum(dim=-1) - top
    count = ((before < wanted[:, None]) & (top > 0)).sum(dim=-1).clamp(min=1)
    return top[torch.arange(len(top)), count - 1]


def test_the_searched_cutoff_is_the_sorted_one_on_varied_rows():
    g = torch.Generator().manual_seed(0)
    v = 3000  # more than two of the kernel's blocks, not a multiple of one
    rows = [
        (torch.randn(v, generator=g) * 3).softmax(-1),  # peaked
        (torch.randn(v, generator=g) * 0.3).softmax(-1),  # flat
        torch.full((v,), 1.0 / v),  # all tied: everything is kept
        torch.nn.functional.one_hot(torch.tensor(17), v).float(),  # one token
    ]
    tied = torch.zeros(v)
    tied[:4], tied[4:10] = 0.2, 0.2 / 6  # the cut-off falls inside a run of ties: all of it stays
    rows.append(tied)
    filtered = (torch.randn(v, generator=g) * 2).softmax(-1)
    filtered[filtered < filtered.median()] = 0.0  # zeros left by min-p / top-k, mass below 1
    rows.append(filtered)
    probs = torch.stack(rows)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        wanted = top_p * probs.sum(dim=-1)
        assert torch.equal(top_p_cutoff(probs, wanted), _sorted_cutoff(probs, wanted)), top_p


def test_the_device_sampler_draws_the_same_tokens_with_the_search_as_with_the_sort():
    g = torch.Generator().manual_seed(1)
    rows = 6
    logits = torch.randn(rows, 2000, generator=g) * 2
    batch = make_batch(
        rows,
        temperature=0.8,
        top_p=[0.3, 0.6, 0.9, 0.95, 1.0, 0.8],
        top_k=[0, 0, 50, 0, 20, 5],
        seed=list(range(rows)),
    )
    sorting = Sampler(sync_free=True)
    searching = Sampler(sync_free=True, top_p_cutoff=top_p_cutoff)
    for step in range(20):
        batch.step = torch.full((rows,), step, dtype=torch.int64)
        assert torch.equal(searching(logits, batch).token_ids, sorting(logits, batch).token_ids)
