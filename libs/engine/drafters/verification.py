"""What a step's sampler needs to verify model drafts: per sequence, the drafts it verifies this
step, q of each, and q of a draft the output's format refused (its position is a rejection: the
token there is drawn from max(0, p - q) normalised, never from p, or the output would not follow p).
Only sampled requests have entries; a greedy request's drafts are verified by comparison."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.engine.speculative_sampling import RejectionRows
from libs.engine.step_inputs import SampleRows


@dataclass
class _Pending:
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), V]
    refused: torch.Tensor | None  # [V]: q of the draft after them, which the format refused


class PendingDrafts:
    """The current step's model drafts of sampled requests, by sequence id."""

    def __init__(self) -> None:
        self._by_seq: dict[int, _Pending] = {}

    def clear(self) -> None:
        self._by_seq.clear()

    def add(self, seq_id: int, tokens: list[int], q: torch.Tensor, refused_at: int | None) -> None:
        """`q`: the drafter's q of every drafted token; the sequence verifies `tokens` (the first
        ones), and `refused_at` is the index of a draft the format refused right after them."""
        refused = None if refused_at is None else q[refused_at]
        self._by_seq[seq_id] = _Pending(list(tokens), q[: len(tokens)] if tokens else None, refused)

    def discard(self, seq_id: int) -> None:
        self._by_seq.pop(seq_id, None)

    def rejection_rows(self, sample: SampleRows) -> RejectionRows | None:
        """The sampled rows whose token the rejection rule decides, or None when there are none."""
        if not self._by_seq:
            return None
        rows: list[int] = []
        tokens: list[int] = []
        q: list[torch.Tensor] = []
        for i, (seq, offset) in enumerate(zip(sample.seqs, sample.offsets, strict=True)):
            pending = self._by_seq.get(seq.seq_id)
            if pending is None:
                continue
            if offset < len(pending.tokens):
                rows.append(i)
                tokens.append(pending.tokens[offset])
                q.append(pending.q[offset])
            elif pending.refused is not None:
                rows.append(i)
                tokens.append(-1)
                q.append(pending.refused)
        if not rows:
            return None
        device = q[0].device
        return RejectionRows(
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.stack(q).float(),
        )
