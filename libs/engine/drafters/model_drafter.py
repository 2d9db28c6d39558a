"""A draft model proposing K tokens per sequence: K batched decode steps through its own KV cache.

The first step of a round feeds each sequence what its slot has not computed yet (the whole prompt
the first time; then the token the target sampled after the kept drafts, and the last kept draft
when all were kept), the next steps one drafted token each. Every sequence of the round shares
each step's forward pass; one with a smaller limit simply leaves the batch earlier.

A greedy request drafts the draft model's argmax. A sampled request draws each draft from q, the
draft model's distribution under the request's temperature, min-p, top-k and top-p, and keeps q:
the target's verification accepts or resamples by the rejection rule (speculative_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from libs.engine.drafters.draft_cache import DraftCache, DraftSlot
from libs.engine.models.decoder import DecoderModel
from libs.engine.sampler import SamplingBatch
from libs.engine.sequence import Sequence
from libs.engine.speculative_sampling import DRAFT_STREAM, distribution, draw, stream_uniform
from libs.engine.staging import Layout, StagingBuffers
from libs.engine.step_inputs import StepShape, add_model_fields, attention_metadata, fill_model_fields


@dataclass
class Draft:
    """A sequence's drafted tokens and, for a sampled request, q of each ([len(tokens), V])."""

    tokens: list[int]
    q: torch.Tensor | None = None


@dataclass
class _Round:
    seq: Sequence
    slot: DraftSlot
    limit: int
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)


class ModelDrafter:
    """Drafts with `model` (its own KV cache of `num_blocks` blocks). `experts_only`: it serves only
    requests with experts (the base model drafting for base + experts)."""

    def __init__(
        self, model: DecoderModel, num_blocks: int, block_size: int, max_model_len: int, experts_only: bool
    ) -> None:
        self.model = model
        self.cache = DraftCache(num_blocks, block_size, model.config, model.dtype, model.device)
        self.max_model_len = max_model_len
        self.experts_only = experts_only
        self.staging = StagingBuffers(model.device)
        self.sync_free = model.device.type == "cuda"

    def serves(self, seq: Sequence) -> bool:
        return bool(seq.experts) or not self.experts_only

    @torch.inference_mode()
    def draft(self, wanted: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        """Up to `limit` drafts for each (sequence, limit); a sequence the cache has no room for
        gets none (it is left out of the result)."""
        rounds = []
        for seq, limit in wanted:
            limit = min(limit, self.max_model_len - seq.num_tokens)
            slot = self.cache.begin(seq, limit) if limit > 0 else None
            if slot is not None:
                rounds.append(_Round(seq, slot, limit))
        active = rounds
        for step in range(max((r.limit for r in rounds), default=0)):
            logits = self._forward([r.slot for r in active])
            tokens, q = self._sample(logits, active, step)
            for i, r in enumerate(active):
                r.slot.num_computed_tokens = r.slot.num_tokens
                r.slot.token_ids.append(tokens[i])
                r.tokens.append(tokens[i])
                if q is not None and r.seq.params.temperature > 0:
                    r.q.append(q[i])
            active = [r for r in active if len(r.tokens) < r.limit]
        return {r.seq.seq_id: Draft(r.tokens, torch.stack(r.q) if r.q else None) for r in rounds}

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)

    def _forward(self, slots: list[DraftSlot]) -> torch.Tensor:
        """Logits [len(slots), V] at each slot's last token, after computing its uncomputed ones."""
        shape = StepShape.build([(s, s.num_tokens - s.num_computed_tokens) for s in slots], 0, None)
        layout = Layout()
        add_model_fields(layout, shape.num_rows, shape.num_tokens, shape.width)
        host = self.staging.stage(layout)
        fill_model_fields(host, shape, self.cache.block_size)
        views = self.staging.send(layout)
        meta = attention_metadata(
            views, int(shape.q_lens.max()), int(shape.seq_lens.max()), self.cache.block_size
        )
        hidden = self.model.forward(views["input_ids"], views["positions"], meta, self.cache.layers)
        last = torch.as_tensor(shape.query_start_loc[1:] - 1, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, last))

    def _sample(
        self, logits: torch.Tensor, rounds: list[_Round], step: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft (argmax for greedy requests, a draw from q otherwise) and q, or None
        when every request is greedy."""
        params = [r.seq.params for r in rounds]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist(), None
        batch = _batch(rounds, step, logits.device)
        q = distribution(logits, batch, self.sync_free)
        tokens = draw(q, stream_uniform(batch, DRAFT_STREAM))
        tokens = torch.where(batch.temperature == 0, logits.argmax(dim=-1), tokens)
        return tokens.tolist(), q


def _batch(rounds: list[_Round], step: int, device: torch.device) -> SamplingBatch:
    """The sampling settings of each row: its request's filters, seed and the draft's output position."""
    params = [r.seq.params for r in rounds]
    seeds = np.array([r.seq.seed for r in rounds], dtype=np.uint64)

    def tensor(values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingBatch(
        temperature=tensor([p.temperature for p in params], torch.float32),
        top_k=tensor([p.top_k for p in params], torch.int64),
        top_p=tensor([p.top_p for p in params], torch.float32),
        min_p=tensor([p.min_p for p in params], torch.float32),
        seed_lo=tensor((seeds & np.uint64(0xFFFFFFFF)).astype(np.int64), torch.int64),
        seed_hi=tensor((seeds >> np.uint64(32)).astype(np.int64), torch.int64),
        step=tensor([r.seq.num_output_tokens + step for r in rounds], torch.int64),
        max_top_k=max(p.top_k for p in params),
        any_top_k=any(p.top_k > 0 for p in params),
        any_top_p=any(p.top_p < 1.0 for p in params),
        any_min_p=any(p.min_p > 0.0 for p in params),
    )
