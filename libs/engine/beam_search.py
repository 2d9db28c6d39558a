"""Beam search over the engine's sequences, scored as transformers' `generate(num_beams=...)`.

`BeamSearch` is the decision alone (token ids and scores, no engine state): each step every
running beam offers its most likely next tokens with their log-probabilities; once all have
offered, the best continuations over all beams become the next beams and those ending in an end
token (or reaching max_tokens) become finished hypotheses. The rules follow transformers'
vectorised beam search step for step, in float32 as it computes:

- the `keep` = max(2, 1 + number of end ids) × width best continuations (accumulated log-prob) are
  taken over all beams; the next beams are the best `width` of them that did not just end;
- a continuation that ended is a hypothesis only if it ranks among the first `width`; its score
  is the accumulated log-prob / (generated length, end token included) ** length_penalty; the
  best `width` hypotheses are kept;
- `early_stopping` True stops once `width` hypotheses exist; False and "never" stop when the best
  running beam, penalised at the current length (at max_tokens for "never" with a positive
  penalty), cannot beat the worst kept hypothesis.

`BeamDriver` applies the decisions to the engine's sequences: a beam continued by several
continuations forks (the children share the parent's KV blocks, and the first write into a shared
partial block copies only that block), a beam continued by none is freed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from libs.engine.sequence import Sequence, SequenceStatus

_F32 = np.float32


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, its length-penalised score and its log-prob sum."""

    token_ids: list[int]
    score: float
    cumulative_logprob: float
    finish_reason: str  # "stop" (an end token), "length" or "abort"


@dataclass
class Beam:
    """A running beam: the sequence that computes it and what it generated so far."""

    seq_id: int
    token_ids: list[int]
    logprob: np.float32  # accumulated log-probability of token_ids
    parent: int = -1  # the seq_id it continues, for a beam just chosen (the driver assigns seq_id)


@dataclass
class BeamSearch:
    """One request's beams and hypotheses (the batch of one prompt in transformers' terms)."""

    width: int
    max_new_tokens: int
    end_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    running: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)  # the best `width`, best first
    offers: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    improvable: bool = True
    done: bool = False

    @property
    def keep(self) -> int:
        """Continuations examined per step: enough that `width` remain after every end token."""
        return max(2, 1 + len(self.end_ids)) * self.width

    def start(self, seq_id: int) -> None:
        self.running = [Beam(seq_id, [], _F32(0.0))]

    def offer(self, seq_id: int, top: list[tuple[int, float]]) -> bool:
        """A running beam's most likely next tokens (id, log-prob); True once every beam offered."""
        self.offers[seq_id] = top
        return all(beam.seq_id in self.offers for beam in self.running)

    def advance(self) -> list[Beam]:
        """One step over all offers: the next beams (their `parent` set, `seq_id` to assign), or []
        when the search is done (`best` then gives the outputs)."""
        generated = len(self.running[0].token_ids)
        candidates = self._candidates()
        at_length = generated + 1 >= self.max_new_tokens
        ended = [at_length or token in self.end_ids for _, _, token in candidates]
        self._add_hypotheses(candidates[: self.width], ended, generated + 1)
        nxt = [c for c, e in zip(candidates, ended, strict=True) if not e][: self.width]
        self.offers.clear()
        if nxt:
            self.improvable = self.improvable and self._can_improve(nxt[0][0], generated + 1)
        full = len(self.finished) == self.width
        self.done = all(ended) or not nxt or not self.improvable or (full and self.early_stopping is True)
        if self.done:
            return []
        return [
            Beam(-1, [*self.running[b].token_ids, token], score, parent=self.running[b].seq_id)
            for score, b, token in nxt
        ]

    def _candidates(self) -> list[tuple[np.float32, int, int]]:
        """The `keep` best (accumulated log-prob, beam index, token) over all beams, best first."""
        scored = [
            (beam.logprob + _F32(logprob), b, token)
            for b, beam in enumerate(self.running)
            for token, logprob in self.offers[beam.seq_id]
        ]
        # A fixed order for exact ties (the lower beam, then the lower token id); torch's top-k in
        # transformers promises none, so an exact tie is the one place the two may differ.
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))
        return scored[: self.keep]

    def _add_hypotheses(self, top: list[tuple[np.float32, int, int]], ended: list[bool], length: int) -> None:
        """The continuations among the first `width` that ended become hypotheses (none once the
        search cannot improve, or once it is full with early_stopping True)."""
        if not self.improvable or (len(self.finished) == self.width and self.early_stopping is True):
            return
        denominator = _F32(float(length) ** self.length_penalty)
        for (logprob, b, token), end in zip(top, ended, strict=False):
            if not end:
                continue
            reason = "stop" if token in self.end_ids else "length"
            tokens = [*self.running[b].token_ids, token]
            self.finished.append(Hypothesis(tokens, float(logprob / denominator), float(logprob), reason))
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[self.width :]

    def _can_improve(self, best_running: np.float32, generated: int) -> bool:
        """Whether the best running beam could still beat the worst kept hypothesis."""
        if len(self.finished) < self.width:
            return True
        length = generated
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        best_possible = best_running / _F32(float(length) ** self.length_penalty)
        return bool(best_possible > _F32(self.finished[-1].score))

    def abort(self) -> None:
        """End the search now: the running beams count as hypotheses, unpenalised."""
        for beam in self.running:
            self.finished.append(
                Hypothesis(beam.token_ids, float(beam.logprob), float(beam.logprob), "abort")
            )
        self.done = True

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses, best first."""
        return self.finished[:n]


@dataclass
class BeamDriver:
    """Turns a BeamSearch's steps into forks, frees and appended tokens of engine sequences."""

    add_fork: Callable[[Sequence, Sequence], None]  # Scheduler.add_fork: share the parent's blocks
    finish: Callable[[Sequence, SequenceStatus], None]  # Scheduler.finish: free its blocks
    seqs: dict[int, Sequence]  # the engine's live sequences by id
    _next_index: dict[str, int] = field(default_factory=dict)

    def on_sample(self, search: BeamSearch, seq: Sequence, top: list[tuple[int, float]]) -> None:
        """A beam's next-token candidates; the step is taken once every running beam has offered."""
        seq.num_pending_forks = 1  # the first sequence's reservation for its beams is used up now
        if not search.offer(seq.seq_id, top):
            return
        old = [self.seqs[beam.seq_id] for beam in search.running]
        beams = search.advance()
        children: dict[int, list[Beam]] = {}
        for beam in beams:
            children.setdefault(beam.parent, []).append(beam)
        for parent in old:
            if parent.seq_id not in children:
                self._drop(
                    parent, SequenceStatus.FINISHED_LENGTH if search.done else SequenceStatus.FINISHED_ABORTED
                )
        for parent in old:
            for i, beam in enumerate(children.get(parent.seq_id, ())):
                target = parent if i == 0 else self._fork(parent)
                beam.seq_id = target.seq_id
        # Forks copy the parent's tokens, so each beam's new token is appended after all forks.
        for beam in beams:
            self.seqs[beam.seq_id].append_token(beam.token_ids[-1])
        search.running = beams

    def abort(self, search: BeamSearch) -> None:
        """Free every running beam and end the search with what it has."""
        for beam in search.running:
            seq = self.seqs.get(beam.seq_id)
            if seq is not None:
                self._drop(seq, SequenceStatus.FINISHED_ABORTED)
        search.abort()

    def _fork(self, parent: Sequence) -> Sequence:
        index = self._next_index.get(parent.request_id, 1)
        self._next_index[parent.request_id] = index + 1
        child = parent.fork(index)
        child.beam_candidates = parent.beam_candidates
        self.add_fork(parent, child)
        self.seqs[child.seq_id] = child
        return child

    def _drop(self, seq: Sequence, status: SequenceStatus) -> None:
        self.finish(seq, status)
        self.seqs.pop(seq.seq_id, None)

    def forget(self, request_id: str) -> None:
        self._next_index.pop(request_id, None)
