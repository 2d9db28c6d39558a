"""Token sampling for a whole batch at once: penalties, temperature, top-k/top-p/min-p, seeds.

Random choices use the Gumbel-max trick with noise that is a pure function of (seed, output
position, token id): row r's sample depends only on its own logits, seed and position, never on
what else is in the batch or on earlier steps of other requests. Same seed, same tokens. The noise
is a counter-based integer hash evaluated with vectorized torch ops (no per-row generators).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


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
    num_logprobs: int = -1  # max top-N logprobs any row wants, -1 = none
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


def gumbel_noise(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """[S, V] float32 standard Gumbel noise, a function of (seed, step, token id) only."""
    row = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32(step & _M32)))  # [S]
    tokens = _mix32(torch.arange(vocab_size, device=row.device, dtype=torch.int64) * 0x9E3779B1 & _M32)
    bits = _mix32(row[:, None] ^ tokens[None, :])  # [S, V] in [0, 2^32)
    # 24 uniform bits in (0, 1), exactly representable in float32; -log(-log(u)) is Gumbel(0, 1).
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    s, v = logits.shape
    if batch.output_tokens is not None:
        counts = torch.zeros(s, v + 1, device=logits.device, dtype=logits.dtype)
        counts.scatter_add_(1, batch.output_tokens, torch.ones_like(batch.output_tokens, dtype=logits.dtype))
        counts = counts[:, :v]
    else:
        counts = torch.zeros_like(logits)
    if batch.repetition_penalty is not None:
        seen = counts > 0
        if batch.prompt_tokens is not None:
            in_prompt = torch.zeros(s, v + 1, device=logits.device, dtype=torch.bool)
            in_prompt.scatter_(1, batch.prompt_tokens, True)
            seen = seen | in_prompt[:, :v]
        penalty = batch.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set; rows with the filter off
    pass through unchanged."""
    neg_inf = torch.finfo(logits.dtype).min
    if batch.any_top_k or batch.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        v = logits.shape[-1]
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        if batch.any_top_k:
            k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=v), v)
            keep &= torch.arange(v, device=logits.device)[None, :] < k[:, None]
        if batch.any_top_p:
            probs = torch.where(keep, sorted_logits, neg_inf).softmax(dim=-1)
            # keep a token if the mass strictly before it is below top_p (the top token always stays)
            before = probs.cumsum(dim=-1) - probs
            # rows with top-p off keep everything (rounding can push a cumulative sum past 1.0)
            keep &= (before < batch.top_p[:, None]) | (batch.top_p[:, None] >= 1.0)
        masked_sorted = torch.where(keep, sorted_logits, neg_inf)
        logits = torch.full_like(logits, neg_inf).scatter(1, order, masked_sorted)
    if batch.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < threshold, neg_inf, logits)
    return logits


class Sampler:
    """Draw one token per row of logits according to the row's settings."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw = logits
        if (
            batch.repetition_penalty is not None
            or batch.frequency_penalty is not None
            or batch.presence_penalty is not None
        ):
            logits = _apply_penalties(logits, batch)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
            scaled = _filter(logits / temperature[:, None], batch)
            noise = gumbel_noise(batch.seed_lo, batch.seed_hi, batch.step, logits.shape[-1])
            sampled = (scaled + noise).argmax(dim=-1)
            tokens = torch.where(batch.temperature > 0, sampled, greedy_tokens)
        out = SamplerOutput(token_ids=tokens)
        if batch.num_logprobs >= 0:
            logprobs = raw.log_softmax(dim=-1)
            out.sampled_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            out.sampled_ranks = (logprobs > out.sampled_logprobs[:, None]).sum(dim=-1) + 1
            if batch.num_logprobs > 0:
                out.top_logprobs, out.top_token_ids = logprobs.topk(batch.num_logprobs, dim=-1)
        return out
