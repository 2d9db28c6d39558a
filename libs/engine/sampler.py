"""Token sampling for a whole batch at once: penalties, temperature, min-p/top-k/top-p, seeds.

Each sampled row draws one uniform number that is a pure function of (seed, output position) — a
counter-based integer hash evaluated with vectorized torch ops, no per-row generators — and picks
its token by inverting the cumulative distribution of its filtered probabilities. A row's token
therefore depends only on its own logits, seed and position, never on what else is in the batch:
same seed, same tokens. Top-k and top-p look at the 256 most likely tokens of a row and sort the
whole row only when those do not hold the requested mass, so the common case never sorts the
vocabulary. On a GPU (`Sampler(sync_free=True)`) nothing waits for the device: a top-p batch sorts
whole rows instead of asking whether the candidates sufficed, and every other fallback is a
`torch.where` over the batch rather than a branch on a device value.

Rows under a structured output format come with a token bitmask: their disallowed tokens get -inf
after the penalties and before anything else, so every filter and draw sees only allowed tokens.
The other rows are not touched at all, and a masked row's numbers depend on its own mask only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

_M32 = 0xFFFFFFFF
# top_p_cutoff(probs, wanted) -> [S]: per row, the smallest probability whose strictly larger
# neighbours hold less than `wanted` (kernels/triton/sampling.py).
TopPCutoff = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
CANDIDATES = 256  # tokens examined for top-k / top-p before falling back to a full sort


@dataclass
class SamplingBatch:
    """Per-row settings, already tensors on the logits' device. Rows are independent."""

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    seed_lo: torch.Tensor  # [S] int64, low 32 bits of the row's seed
    seed_hi: torch.Tensor  # [S] int64, high 32 bits
    step: torch.Tensor  # [S] int64, index of the output token being sampled
    repetition_penalty: torch.Tensor | None = None  # [S], only when some row uses a penalty
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None  # [S, Lp] int64 padded with vocab_size
    output_tokens: torch.Tensor | None = None  # [S, Lo] int64 padded with vocab_size
    # [S, Le] int64 padded with vocab_size: ids no penalty touches (EOS, stop ids, control tokens)
    penalty_exempt: torch.Tensor | None = None
    # Structured output: the rows with a format, and their allowed tokens as bits ([C, ceil(V/32)]
    # int32; bit i of word j allows token 32 * j + i).
    constrained_rows: torch.Tensor | None = None  # [C] int64
    allowed_tokens: torch.Tensor | None = None
    num_logprobs: int = -1  # max top-N logprobs any row wants, -1 = none
    max_top_k: int = 0  # the largest top_k of any row (host-known, so no device value sizes a tensor)
    all_greedy: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    sampled_logprobs: torch.Tensor | None = None  # [S] float32
    sampled_ranks: torch.Tensor | None = None  # [S] int64, 1 = the most likely token
    top_logprobs: torch.Tensor | None = None  # [S, N] float32
    top_token_ids: torch.Tensor | None = None  # [S, N] int64


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2^32 for h < 2^32, in two 16-bit halves so int64 never overflows.
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # MurmurHash3's 32-bit finalizer: every input bit affects every output bit.
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[S] float64 in [0, 1) with 53 random bits, a function of (seed, step) only."""
    h1 = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32(step & _M32)))
    h2 = _mix32(h1 ^ 0x68E31DA4)
    bits = (h1 >> 5) * (1 << 26) + (h2 >> 6)  # 27 + 26 bits
    return bits.to(torch.float64) * (1.0 / (1 << 53))


def _token_mask(tokens: torch.Tensor, s: int, v: int) -> torch.Tensor:
    """[S, V] bool: the ids of each row of `tokens` (padded with v)."""
    mask = torch.zeros(s, v + 1, device=tokens.device, dtype=torch.bool)
    mask.scatter_(1, tokens, True)
    return mask[:, :v]


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's penalties, then each row's exempt ids (EOS, stop ids, control tokens) get their logits
    back: no penalty can keep a model from ending its turn, however often the prompt holds the
    end-of-turn token."""
    s, v = logits.shape
    raw = logits
    if batch.output_tokens is not None:
        counts = torch.zeros(s, v + 1, device=logits.device, dtype=logits.dtype)
        counts.scatter_add_(1, batch.output_tokens, torch.ones_like(batch.output_tokens, dtype=logits.dtype))
        counts = counts[:, :v]
    else:
        counts = torch.zeros_like(logits)
    if batch.repetition_penalty is not None:
        seen = counts > 0
        if batch.prompt_tokens is not None:
            seen = seen | _token_mask(batch.prompt_tokens, s, v)
        penalty = batch.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    if batch.penalty_exempt is not None:
        logits = torch.where(_token_mask(batch.penalty_exempt, s, v), raw, logits)
    return logits


def _allow_only(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf for every token a constrained row's bitmask leaves out (a new tensor;
    rows not listed keep their values bit for bit)."""
    v = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :v]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def _filter(
    probs: torch.Tensor, batch: SamplingBatch, sort_all: bool = False, top_p_cutoff: TopPCutoff | None = None
) -> torch.Tensor:
    """Zero the probabilities outside each row's min-p, then top-k, then top-p set (vLLM's order);
    rows with a filter off pass through it unchanged. Ties at a cut-off value are all kept.
    `sort_all`: top-p looks at whole sorted rows (the same cut-offs, without a host sync), unless
    `top_p_cutoff` finds them without sorting (kernels/triton/sampling.py)."""
    s, v = probs.shape
    if batch.any_min_p:
        floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, 0.0)
    if not (batch.any_top_k or batch.any_top_p):
        return probs
    rows = torch.arange(s, device=probs.device)
    k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=v), v)
    width = min(v, max(CANDIDATES, batch.max_top_k if batch.any_top_k else 0))
    if batch.any_top_p and top_p_cutoff is not None:
        return _cut_top_p(probs, batch, k, width, top_p_cutoff)
    if sort_all and batch.any_top_p:
        width = v
    top = probs.topk(width, dim=-1).values  # [S, width], descending
    cutoff = torch.zeros(s, dtype=probs.dtype, device=probs.device)
    if batch.any_top_k:
        kth = top[rows, (k - 1).clamp(max=width - 1)]
        cutoff = torch.where(batch.top_k > 0, kth, cutoff)
        top = torch.where(top >= cutoff[:, None], top, 0.0)
    if batch.any_top_p:
        # Mass is relative to what the earlier filters kept (all of it lies in `top` when top-k is on).
        kept = torch.where(probs >= cutoff[:, None], probs, 0.0).sum(dim=-1)
        wanted = batch.top_p * kept
        active = batch.top_p < 1.0
        short = active & (top.sum(dim=-1) < wanted)
        if width < v and bool(short.any()):  # the nucleus reaches past the candidates: sort those rows
            full = (
                torch.where(probs >= cutoff[:, None], probs, 0.0)[short].sort(dim=-1, descending=True).values
            )
            top = torch.cat([top, top.new_zeros(s, v - width)], dim=-1) if width < v else top
            top[short] = full
        # keep a token while the mass strictly before it is below top_p (the top token always stays)
        before = top.cumsum(dim=-1) - top
        count = ((before < wanted[:, None]) & (top > 0)).sum(dim=-1).clamp(min=1)
        last = top[rows, count - 1]
        cutoff = torch.where(active, torch.maximum(cutoff, last), cutoff)
    return torch.where(probs >= cutoff[:, None], probs, 0.0)


def _cut_top_p(
    probs: torch.Tensor, batch: SamplingBatch, k: torch.Tensor, width: int, top_p_cutoff: TopPCutoff
) -> torch.Tensor:
    """Top-k then top-p as `_filter` does, with top-p's cut-off searched, not sorted for: no host
    sync and no sort of the vocabulary (top-k's k-th value still comes from a top-k of `width`)."""
    s = probs.shape[0]
    cutoff = torch.zeros(s, dtype=probs.dtype, device=probs.device)
    if batch.any_top_k:
        kth = probs.topk(width, dim=-1).values[
            torch.arange(s, device=probs.device), (k - 1).clamp(max=width - 1)
        ]
        cutoff = torch.where(batch.top_k > 0, kth, cutoff)
    kept = torch.where(probs >= cutoff[:, None], probs, 0.0)
    last = top_p_cutoff(kept, batch.top_p * kept.sum(dim=-1))
    cutoff = torch.where(batch.top_p < 1.0, torch.maximum(cutoff, last), cutoff)
    return torch.where(probs >= cutoff[:, None], probs, 0.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token where each row's cumulative (unnormalized) probability first exceeds u * total.

    Two levels so that only one pass touches the whole vocabulary: sums of blocks of 256 tokens
    (accumulated in float64) locate the block, then a cumulative sum inside that block locates the token.
    """
    s, v = probs.shape
    block = 256
    padded = -(-v // block) * block
    if padded != v:
        probs = torch.cat([probs, probs.new_zeros(s, padded - v)], dim=-1)
    blocks = probs.view(s, padded // block, block)
    outer = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [S, blocks]
    target = u * outer[:, -1]
    index = torch.searchsorted(outer, target[:, None], right=True).clamp(max=outer.shape[1] - 1)
    before = torch.where(index > 0, outer.gather(1, (index - 1).clamp(min=0)), 0.0).squeeze(1)
    inner = blocks[torch.arange(s, device=probs.device), index.squeeze(1)].double().cumsum(dim=-1)
    offset = torch.searchsorted(inner, (target - before)[:, None], right=True).squeeze(1)
    tokens = index.squeeze(1) * block + offset.clamp(max=block - 1)
    # Rounding can put the target at (or past) the very end, or on a zero-probability token:
    # fall back to the most likely token, which is always allowed.
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    bad = (offset >= block) | (chosen <= 0)
    return torch.where(bad, probs.argmax(dim=-1), tokens)


class Rejection(Protocol):
    """Rows whose tokens a rule other than the plain draw decides (speculative_sampling.RejectionRows)."""

    def apply(self, probs: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`tokens` with those rows' tokens replaced, given the filtered probabilities [S, V]."""


@dataclass(frozen=True)
class SampledToken:
    """One sequence's token from a step, as the runner hands it to its request."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None  # of the sampled token in the model's distribution, 1 = most likely
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Draw one token per row of logits according to the row's settings."""

    def __init__(
        self,
        sync_free: bool = False,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        top_p_cutoff: TopPCutoff | None = None,
    ) -> None:
        """`argmax`: the operator set's greedy pick over [S, V] logits (the native kernels' splits
        the rows over the threads); torch.argmax by default. `top_p_cutoff`: the operator set's
        search for top-p's cut-off, used when `sync_free` (else a sort of the vocabulary is)."""
        self.sync_free = sync_free
        self.argmax = argmax if argmax is not None else (lambda logits: logits.argmax(dim=-1))
        self.top_p_cutoff = top_p_cutoff if sync_free else None

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, rejection: Rejection | None = None
    ) -> SamplerOutput:
        """`rejection`: rows verifying a model drafter's sampled drafts (speculative_sampling.py),
        whose tokens the rejection rule decides; only with sampled (temperature > 0) rows."""
        logits = logits.float()
        raw = logits
        if (
            batch.repetition_penalty is not None
            or batch.frequency_penalty is not None
            or batch.presence_penalty is not None
        ):
            logits = _apply_penalties(logits, batch)
        if batch.allowed_tokens is not None:
            # After the penalties, which hand the end-of-sequence ids their raw logits back.
            logits = _allow_only(logits, batch.constrained_rows, batch.allowed_tokens)
        if batch.all_greedy:
            tokens = self.argmax(logits)
        else:
            temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
            probs = _filter(
                (logits / temperature[:, None]).softmax(dim=-1), batch, self.sync_free, self.top_p_cutoff
            )
            tokens = _inverse_cdf(probs, uniform(batch.seed_lo, batch.seed_hi, batch.step))
            if rejection is not None:
                tokens = rejection.apply(probs, tokens, batch)
            tokens = torch.where(batch.temperature == 0, self.argmax(logits), tokens)
        out = SamplerOutput(token_ids=tokens)
        if batch.num_logprobs >= 0:
            logprobs = raw.log_softmax(dim=-1)
            out.sampled_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            out.sampled_ranks = (logprobs > out.sampled_logprobs[:, None]).sum(dim=-1) + 1
            if batch.num_logprobs > 0:
                out.top_logprobs, out.top_token_ids = logprobs.topk(batch.num_logprobs, dim=-1)
        return out
