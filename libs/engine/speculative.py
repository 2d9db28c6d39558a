"""Speculative decoding: drafters that propose a sequence's next tokens, and the acceptance rule.

A decoding sequence may carry up to K drafted tokens into a step. The step computes its last real
token and the K drafts together, like a prompt chunk after the cached prefix, so the model scores
K + 1 positions in one forward pass. Each position is sampled exactly as ordinary decoding would
sample it there (same logits, penalties, format mask, seed and output position), and the drafts
are kept up to the first position whose sample differs from the draft; that sample is kept too
(or, when every draft matched, the sample after the last one). See docs/engine.md#speculative-decoding
for why this is the standard rejection rule for a drafter that proposes one token with certainty.
A model drafter's drafts for a sampled request come with their distribution q instead, and the
sampler decides them by the rule for q (speculative_sampling.py); its greedy drafts are certain.

The n-gram drafter needs no model: it finds the most recent earlier occurrence of the sequence's
last n tokens (n from NGRAM_MAX down to NGRAM_MIN) in its prompt and output and proposes the
tokens that followed it, at most 2^n of them: a longer match is better evidence that the text is
being copied. Pure host code, no torch (the model drafters are in drafters/).

Drafts are rows the step computes. A step of few rows streams the weights once whatever its rows,
so drafts are nearly free at batch 1; as rows grow the step turns compute-bound and every draft
costs its share. So a step carries drafts only up to `max_rows` rows in all (its decodes count
first): a batch that fills them decodes as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from libs.engine.config import DRAFT_PREFIX, SPECULATIVE_DRAFTERS, valid_drafter
from libs.engine.outputs import SpeculativeStats
from libs.engine.sequence import Sequence, SpeculationState

if TYPE_CHECKING:
    from libs.engine.drafters.model_drafter import Draft, ModelDrafter
    from libs.engine.drafters.verification import PendingDrafts

DRAFTERS = SPECULATIVE_DRAFTERS
NGRAM_MAX = 4
NGRAM_MIN = 1
# Adapting K: a sequence whose drafts are accepted less often than this (a running average over
# its recent steps) stops drafting for a while, decoding one token per step as without speculation.
MIN_ACCEPTANCE = 0.3
ACCEPTANCE_DECAY = 0.7  # weight of the past in the running average
MAX_BACKOFF = 128  # the longest pause (SpeculationState.backoff doubles up to it)
MIN_MODEL_DRAFTS = 2  # a model drafter drafts only when each decoding sequence may carry this many


@dataclass
class DrafterStats:
    """Counters of one drafter, for metrics: tokens proposed and accepted, verification steps."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    fallbacks: int = 0  # times a sequence stopped drafting for low acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def ngram_proposal(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to min(k, 2^n) tokens that followed the most recent earlier occurrence of the last n
    tokens of `tokens`, trying the longest n first; [] when no suffix of n_min tokens or more recurs."""
    length = len(tokens)
    if k <= 0 or length <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that start early enough to have at least one token after them, before the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + min(k, 1 << n)].tolist()
    return []


def _share(wanted: list[tuple[Sequence, int]], budget: int, each: int) -> list[tuple[Sequence, int]]:
    """The step's draft budget shared out in order (most important first), at most `each` per
    sequence: a draft's first positions are the likeliest kept, so many short drafts beat few long."""
    shared = []
    for seq, limit in wanted:
        take = min(limit, each, budget)
        if take <= 0:
            break
        shared.append((seq, take))
        budget -= take
    return shared


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many drafts are kept: those before the first position whose sample differs from them."""
    for i, token in enumerate(draft):
        if sampled[i] != token:
            return i
    return len(draft)


class Speculator:
    """Proposes drafts for decoding sequences and keeps each sequence's K and the counters.

    `model`: a model drafter (drafters/model_drafter.py), or None for the n-gram drafter alone. A
    model drafter drafts for all the decoding sequences of a step at once (`prepare`, before the
    scheduler hands out the step's budget); a sequence it does not serve (the base drafter and a
    request without experts) drafts with the n-gram drafter. `pending`: where the drafts of sampled
    requests wait, with their q, for the step's sampler (drafters/verification.py). `max_rows`: the
    most rows (decodes and drafts) a step carries drafts up to."""

    def __init__(
        self,
        drafter: str,
        k: int,
        model: ModelDrafter | None = None,
        pending: PendingDrafts | None = None,
        max_rows: int = 16,
    ) -> None:
        if drafter == "off" or not valid_drafter(drafter):
            raise ValueError(f"speculative: expected one of {', '.join(DRAFTERS[1:])}, got {drafter!r}")
        self.drafter = DRAFT_PREFIX.rstrip(":") if drafter.startswith(DRAFT_PREFIX) else drafter
        self.k = k
        self.max_rows = max_rows
        self._budget = 0  # drafts this step may still carry (prepare sets it)
        self._each = 0  # and the most one sequence may carry
        self.model = model
        self.pending = pending
        self.stats = DrafterStats()
        self.ngram_stats = DrafterStats() if model is not None and model.experts_only else None
        self._prepared: dict[int, Draft] = {}
        self._reserved: dict[int, int] = {}

    def wants(self, seq: Sequence) -> bool:
        """Whether the sequence drafts at all: its request's choice, else the engine's (on)."""
        return seq.params.speculative is not False and seq.num_pending_forks == 1

    def _state(self, seq: Sequence) -> SpeculationState:
        if seq.speculation is None:
            seq.speculation = SpeculationState(self.k)
        return seq.speculation

    def _limit(self, seq: Sequence, room: int, max_model_len: int) -> int:
        limit = min(self._state(seq).k, room, max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
        return limit

    def _by_model(self, seq: Sequence) -> bool:
        return self.model is not None and self.model.serves(seq)

    def prepare(self, decoding: list[Sequence], max_model_len: int) -> None:
        """Start a step: the model drafter drafts for every decoding sequence that will ask (up to
        its K), in one batch; nothing for the n-gram drafter, which drafts on demand."""
        self._prepared, self._reserved = {}, {}
        self._budget = max(0, self.max_rows - len(decoding))
        self._each = max(1, self._budget // max(1, len(decoding)))
        if self.pending is not None:
            self.pending.clear()
        # A model drafter runs a step per draft position whatever the batch: with fewer than
        # MIN_MODEL_DRAFTS rows per sequence left its steps cost more than the drafts save.
        if self.model is None or self._each < MIN_MODEL_DRAFTS:
            return
        wanted = []
        for seq in decoding:
            if self.wants(seq) and self._by_model(seq) and self._state(seq).pause == 0:
                limit = self._limit(seq, self.k, max_model_len)
                if limit > 0:
                    wanted.append((seq, limit))
        wanted = _share(wanted, self._budget, self._each)
        if wanted:
            self._prepared = self.model.draft(wanted)

    def propose(self, seq: Sequence, room: int, max_model_len: int) -> list[int]:
        """The drafts for the sequence's next step: at most its current K, `room` tokens of the
        step's budget, what max_tokens and the context window leave, and only tokens its format
        allows in a row. [] while it is paused for low acceptance."""
        state = self._state(seq)
        if state.pause > 0:
            state.pause -= 1
            return []
        limit = min(self._limit(seq, room, max_model_len), self._budget, self._each)
        if limit <= 0:
            return []
        if not self._by_model(seq):
            draft = ngram_proposal(seq.token_ids[seq.num_virtual_tokens :], limit)
            draft = draft[: seq.grammar.validate(draft)] if draft and seq.grammar is not None else draft
            self._budget -= len(draft)
            return draft
        prepared = self._prepared.pop(seq.seq_id, None)
        if prepared is None:  # the drafter's cache had no room for it
            return []
        draft = prepared.tokens[:limit]
        self._budget -= len(draft)
        # Slots for every draft, whatever the format keeps of them: which tokens the format refuses
        # depends on their values, and what the verification can do must not.
        self._reserved[seq.seq_id] = len(draft)
        kept = seq.grammar.validate(draft) if draft and seq.grammar is not None else len(draft)
        if prepared.q is not None and self.pending is not None:
            self.pending.add(seq.seq_id, draft[:kept], prepared.q, kept if kept < len(draft) else None)
        return draft[:kept]

    def reserved(self, seq: Sequence, draft: list[int]) -> int:
        """KV slots to reserve after the sequence's last token for its drafts this step."""
        return self._reserved.get(seq.seq_id, len(draft))

    def discard(self, seq: Sequence) -> None:
        """The sequence verifies nothing this step (no slots for its drafts): it decodes as usual."""
        self._reserved.pop(seq.seq_id, None)
        if self.pending is not None:
            self.pending.discard(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: the model drafter frees its blocks."""
        if self.model is not None:
            self.model.release(seq)

    def snapshot(self) -> SpeculativeStats:
        st = self.stats
        return SpeculativeStats(self.drafter, st.drafted, st.accepted, st.steps, st.fallbacks)

    def fallback_snapshot(self) -> SpeculativeStats | None:
        """The n-gram drafter's counters for the requests the base drafter does not serve."""
        st = self.ngram_stats
        return (
            None if st is None else SpeculativeStats("ngram", st.drafted, st.accepted, st.steps, st.fallbacks)
        )

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Account for one verification and adapt the sequence: a model drafter's next K is one
        more than it just kept (up to the engine's K: each draft costs a drafter step), the n-gram
        drafter's stays (its match length bounds each draft); a pause when acceptance runs low."""
        state = seq.speculation
        by_model = self._by_model(seq)
        stats = self.stats if self.ngram_stats is None or by_model else self.ngram_stats
        stats.drafted += drafted
        stats.accepted += accepted
        stats.steps += 1
        state.drafted += drafted
        state.accepted += accepted
        if by_model:
            state.k = max(1, min(self.k, accepted + 1))
        rate = accepted / drafted
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * rate
        if state.acceptance < MIN_ACCEPTANCE:
            state.pause = state.backoff
            state.backoff = min(MAX_BACKOFF, state.backoff * 2)
            state.acceptance = 1.0  # a fresh start after the pause
            stats.fallbacks += 1
