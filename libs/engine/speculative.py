"""Speculative decoding: drafters that propose a sequence's next tokens, and the acceptance rule.

A decoding sequence may carry up to K drafted tokens into a step. The step computes its last real
token and the K drafts together, like a prompt chunk after the cached prefix, so the model scores
K + 1 positions in one forward pass. Each position is sampled exactly as ordinary decoding would
sample it there (same logits, penalties, format mask, seed and output position), and the drafts
are kept up to the first position whose sample differs from the draft; that sample is kept too
(or, when every draft matched, the sample after the last one). See docs/engine.md#speculative-decoding
for why this is the standard rejection rule for a drafter that proposes one token with certainty.

The n-gram drafter needs no model: it finds the most recent earlier occurrence of the sequence's
last n tokens (n from NGRAM_MAX down to NGRAM_MIN) in its prompt and output and proposes the
tokens that followed it. Pure host code, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libs.engine.config import SPECULATIVE_DRAFTERS
from libs.engine.outputs import SpeculativeStats
from libs.engine.sequence import Sequence, SpeculationState

DRAFTERS = SPECULATIVE_DRAFTERS
NGRAM_MAX = 4
NGRAM_MIN = 2
# Adapting K: a sequence whose drafts are accepted less often than this (a running average over
# its recent steps) stops drafting for a while, decoding one token per step as without speculation.
MIN_ACCEPTANCE = 0.3
ACCEPTANCE_DECAY = 0.7  # weight of the past in the running average
MAX_BACKOFF = 128  # the longest pause (SpeculationState.backoff doubles up to it)


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
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens of
    `tokens`, trying the longest n first; [] when no suffix of n_min tokens or more recurs."""
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
            return arr[start : start + k].tolist()
    return []


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many drafts are kept: those before the first position whose sample differs from them."""
    for i, token in enumerate(draft):
        if sampled[i] != token:
            return i
    return len(draft)


class Speculator:
    """Proposes drafts for decoding sequences and keeps each sequence's K and the counters."""

    def __init__(self, drafter: str, k: int) -> None:
        if drafter not in DRAFTERS or drafter == "off":
            raise ValueError(f"speculative: expected one of {', '.join(DRAFTERS[1:])}, got {drafter!r}")
        self.drafter = drafter
        self.k = k
        self.stats = DrafterStats()

    def wants(self, seq: Sequence) -> bool:
        """Whether the sequence drafts at all: its request's choice, else the engine's (on)."""
        return seq.params.speculative is not False and seq.num_pending_forks == 1

    def propose(self, seq: Sequence, room: int, max_model_len: int) -> list[int]:
        """The drafts for the sequence's next step: at most its current K, `room` tokens of the
        step's budget, what max_tokens and the context window leave, and only tokens its format
        allows in a row. [] while it is paused for low acceptance."""
        state = seq.speculation
        if state is None:
            state = seq.speculation = SpeculationState(self.k)
        if state.pause > 0:
            state.pause -= 1
            return []
        limit = min(state.k, room, max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
        if limit <= 0:
            return []
        draft = ngram_proposal(seq.token_ids[seq.num_virtual_tokens :], limit)
        if draft and seq.grammar is not None:
            draft = draft[: seq.grammar.validate(draft)]
        return draft

    def snapshot(self) -> SpeculativeStats:
        st = self.stats
        return SpeculativeStats(self.drafter, st.drafted, st.accepted, st.steps, st.fallbacks)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Account for one verification and adapt the sequence's K: one more than it just kept
        (up to the engine's K), and a pause when its acceptance runs low."""
        stats, state = self.stats, seq.speculation
        stats.drafted += drafted
        stats.accepted += accepted
        stats.steps += 1
        state.drafted += drafted
        state.accepted += accepted
        state.k = max(1, min(self.k, accepted + 1))
        rate = accepted / drafted
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * rate
        if state.acceptance < MIN_ACCEPTANCE:
            state.pause = state.backoff
            state.backoff = min(MAX_BACKOFF, state.backoff * 2)
            state.acceptance = 1.0  # a fresh start after the pause
            stats.fallbacks += 1
