"""The rejection rule for drafts sampled from a model drafter's distribution q.

A drafted token x at a position is kept with probability min(1, p(x) / q(x)), p being the target's
distribution there exactly as the sampler would draw from it (penalties, format mask, temperature,
min-p / top-k / top-p, normalised). On rejection the position's token is drawn from
max(0, p - q) normalised, which never gives x back. This yields exactly p at every position
(Leviathan et al. 2023, Chen et al. 2023); docs/engine.md#speculative-decoding says why.

Every random number is a pure function of (the sequence's seed, the output position, a stream):
the drafter's draw, the acceptance test and the resample each have a stream of their own, and the
token after the last kept draft is the sampler's own draw. So a seeded request's tokens are
reproducible, and independent of what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.engine.sampler import SamplingBatch, _filter, _inverse_cdf, uniform

# Constants XORed into the low seed word to separate the streams (arbitrary odd 32-bit values).
DRAFT_STREAM = 0x2545F491
ACCEPT_STREAM = 0x9E3779B1
RESIDUAL_STREAM = 0x7FEB352D


def stream_uniform(batch: SamplingBatch, stream: int) -> torch.Tensor:
    """[S] float64 in [0, 1): each row's draw at its output position in `stream`."""
    return uniform(batch.seed_lo ^ stream, batch.seed_hi, batch.step)


def distribution(logits: torch.Tensor, batch: SamplingBatch, sort_all: bool = False) -> torch.Tensor:
    """[S, V] float32 rows summing to 1: softmax(logits / temperature) after min-p, top-k and top-p,
    as the sampler filters (rows with temperature 0 get the argmax's one-hot)."""
    logits = logits.float()
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    probs = _filter((logits / temperature[:, None]).softmax(dim=-1), batch, sort_all)
    greedy = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.where((batch.temperature == 0)[:, None], greedy, probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[S] int64: the inverse-CDF draw of each row of `probs` at its uniform number."""
    return _inverse_cdf(probs, u)


@dataclass
class RejectionRows:
    """The sampled rows of a step that verify a drafted token against its q.

    `rows` index the sampler's rows; `tokens` are the drafts they verify, or -1 where the drafter's
    token was refused by the output's format before verification (p of it is 0: always rejected);
    `q` is the drafter's distribution each draft was drawn from."""

    rows: torch.Tensor  # [R] int64
    tokens: torch.Tensor  # [R] int64
    q: torch.Tensor  # [R, V] float32, rows sum to 1

    def apply(self, probs: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`tokens` with each listed row replaced by its kept draft or its resample. `probs`: the
        sampler's filtered probabilities [S, V] (unnormalised)."""
        p = probs.index_select(0, self.rows).float()
        p = p / p.sum(dim=-1, keepdim=True)
        drafted = self.tokens.clamp(min=0)[:, None]
        p_x = p.gather(1, drafted).squeeze(1)
        q_x = self.q.gather(1, drafted).squeeze(1)
        u = stream_uniform(batch, ACCEPT_STREAM).index_select(0, self.rows)
        accept = (self.tokens >= 0) & (u * q_x < p_x)
        residual = (p - self.q).clamp(min=0.0)
        # p <= q everywhere means p == q: nothing is ever rejected there, but rounding may; draw from p.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        resampled = draw(residual, stream_uniform(batch, RESIDUAL_STREAM).index_select(0, self.rows))
        return tokens.index_copy(0, self.rows, torch.where(accept, self.tokens, resampled))
