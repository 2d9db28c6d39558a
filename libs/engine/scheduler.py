"""Token-budget continuous batching with chunked prefill, priorities with aging, and preemption.

Each step gets a budget of tokens. Running sequences that are decoding go first (one token each),
then running sequences in the middle of a prompt (a chunk each, as much as the budget leaves), then
waiting sequences in priority order, a chunk each. So a long prompt is spread over several steps
and never holds back the running decodes. When a running sequence needs a block and the pool is
empty, the least important running sequence (lowest effective priority, then latest arrival) is
preempted: its blocks are freed and it goes back to waiting, to be recomputed later from its
tokens (which the prefix cache often makes cheap). Before any running sequence is preempted, the
blocks that idle sessions keep between turns are given up, least recently used first
(`sessions.py`). A waiting sequence that does not fit may
likewise preempt running ones of strictly lower effective priority. Effective priority =
priority + seconds since arrival / aging_seconds, so nothing starves. Higher values are more
important.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from libs.engine.block_manager import KVCacheManager
from libs.engine.config import SchedulerConfig
from libs.engine.sequence import Sequence, SequenceStatus
from libs.engine.sessions import SessionTable
from libs.engine.speculative import Speculator, accepted_prefix

_ADMITTED, _NO_BLOCKS, _NO_ROOM = object(), object(), object()  # how an admission went


@dataclass
class SchedulerOutput:
    """What to compute this step: (sequence, number of its next tokens), decodes first."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdapterResidency(Protocol):
    """Where the experts a running sequence applies must be (the device tier)."""

    def acquire(self, experts: list) -> bool:
        """Make the experts resident and pin them, or change nothing and return False."""

    def release(self, experts: list) -> None:
        """Unpin experts acquired before."""


@dataclass
class _Step:
    """The step being built: remaining token budget, what is scheduled, who was preempted."""

    budget: int
    scheduled: dict[int, tuple[Sequence, int]] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.scheduled[seq.seq_id] = (seq, num_new)
        self.budget -= num_new


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterResidency | None = None,
        sessions: SessionTable | None = None,
        speculator: Speculator | None = None,
        max_model_len: int = 1 << 30,
    ) -> None:
        self.config = config
        self.speculator = speculator  # drafts for decoding sequences (speculative.py), or None
        self.max_model_len = max_model_len
        self.kv = kv
        self.clock = clock
        self.adapters = adapters  # needed only when sequences carry experts
        self.sessions = sessions  # needed only when sequences are session turns
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """A running sequence's sibling, sharing its blocks (and its experts, already resident)."""
        if child.experts and not self.adapters.acquire(child.adapter_experts):
            raise RuntimeError("a fork's experts must be resident: its parent pins them")
        self.kv.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (stopped, length, aborted) and free its blocks, or keep them for the
        next turn of its session."""
        if seq in self.running:
            self.running.remove(seq)
            self._release_adapters(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        if self.speculator is not None:
            self.speculator.release(seq)
        if seq.session_id is None or self.sessions is None or not self.sessions.park(seq):
            self.kv.free(seq)

    def _evict_idle_session(self) -> bool:
        """Free the blocks an idle session keeps, before anything running is preempted."""
        return self.sessions is not None and self.sessions.evict_one()

    def _effective_priority(self, seq: Sequence, now: float) -> float:
        aging = self.config.aging_seconds
        return seq.priority + ((now - seq.arrival_time) / aging if aging > 0 else 0.0)

    def _release_adapters(self, seq: Sequence) -> None:
        if seq.experts:
            self.adapters.release(seq.adapter_experts)

    def _preempt(self, seq: Sequence) -> None:
        seq.discard_draft()
        if self.speculator is not None:
            self.speculator.discard(seq)
            self.speculator.release(seq)
        self.running.remove(seq)
        self._release_adapters(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_preemptions_total += 1

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget; may preempt to make room."""
        now = self.clock()
        priority = {seq.seq_id: self._effective_priority(seq, now) for seq in self.running + self.waiting}

        def key(seq: Sequence) -> tuple[float, float, int]:
            # Most important first: higher effective priority, then earlier arrival.
            return (-priority[seq.seq_id], seq.arrival_time, seq.seq_id)

        step = _Step(self.config.max_num_batched_tokens)
        ordered = sorted(self.running, key=key)
        decoding = [s for s in ordered if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in ordered if s.num_uncomputed_tokens > 1]
        self._prepare_drafts(decoding)
        for place, seq in enumerate(decoding + prefilling):
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, step.budget)
            if num_new == 0:
                continue
            if place < len(decoding):  # drafts only from budget the decodes after it do not need
                num_new += self._draft(seq, step.budget - (len(decoding) - place))
            while not self.kv.allocate_slots(seq, num_new):
                if self._evict_idle_session():
                    continue
                victim = max(self.running, key=key)
                self._preempt_in_step(victim, step)
                if victim is seq:
                    break
            else:
                step.add(seq, num_new)

        if not step.preempted:  # after making room by preemption, admitting would only churn
            self._admit(key, priority, step)
        return SchedulerOutput(list(step.scheduled.values()), self.kv.take_copies(), step.preempted)

    def _prepare_drafts(self, decoding: list[Sequence]) -> None:
        """A model drafter drafts for all the decoding sequences at once, before budgets are known."""
        if self.speculator is not None:
            self.speculator.prepare(decoding, self.max_model_len)

    def _draft(self, seq: Sequence, room: int) -> int:
        """Give a decoding sequence drafted tokens to verify this step, when its drafter proposes
        some and the pool has their slots (never preempting for them); returns how many."""
        spec = self.speculator
        if spec is None or room <= 0 or not spec.wants(seq):
            return 0
        draft = spec.propose(seq, room, self.max_model_len)
        reserve = spec.reserved(seq, draft)
        if not reserve or not self.kv.allocate_slots(seq, 1 + reserve):
            spec.discard(seq)
            return 0
        seq.add_draft(draft)
        return len(draft)

    def _preempt_in_step(self, victim: Sequence, step: _Step) -> None:
        self._preempt(victim)
        step.preempted.append(victim)
        if victim.seq_id in step.scheduled:
            step.budget += step.scheduled.pop(victim.seq_id)[1]

    def _admit(
        self, key: Callable[[Sequence], tuple[float, float, int]], priority: dict[int, float], step: _Step
    ) -> None:
        """Move waiting sequences to running, most important first, while budget and blocks last.

        Strict priority order: when the most important waiting sequence does not fit, nothing behind
        it jumps the queue; instead running sequences of strictly lower effective priority are
        preempted to make room for it.
        """
        admitted: set[int] = set()
        for seq in sorted(self.waiting, key=key):
            while (outcome := self._try_admit(seq, step)) is not _ADMITTED:
                if outcome is _NO_BLOCKS and self._evict_idle_session():
                    continue
                victim = max(self.running, key=key, default=None)
                if step.budget == 0 or victim is None or priority[victim.seq_id] >= priority[seq.seq_id]:
                    self.waiting = [s for s in self.waiting if s.seq_id not in admitted]
                    return
                self._preempt_in_step(victim, step)
            admitted.add(seq.seq_id)
        self.waiting = [s for s in self.waiting if s.seq_id not in admitted]

    def _try_admit(self, seq: Sequence, step: _Step) -> object:
        """_ADMITTED, _NO_BLOCKS when only the KV pool is short, _NO_ROOM otherwise."""
        # A request with n outputs will fork into n running sequences: count them all now.
        if step.budget == 0 or len(self.running) + seq.num_pending_forks > self.config.max_num_seqs:
            return _NO_ROOM
        # Its experts must be on the device before it runs (they may not fit while others are pinned).
        if seq.experts and not self.adapters.acquire(seq.adapter_experts):
            return _NO_ROOM
        # A session turn continuing its kept KV starts after it; anything else looks for a cached prefix.
        resumed = seq.num_computed_tokens > 0
        cached = [] if resumed else self.kv.find_cached_prefix(seq)
        num_cached = seq.num_computed_tokens if resumed else len(cached) * self.kv.block_size
        num_new = min(seq.num_tokens - num_cached, step.budget)
        # The watermark keeps admissions from forcing preemptions; an idle engine needs none.
        if not self.kv.allocate_slots(seq, num_new, cached, keep_watermark=bool(self.running)):
            self._release_adapters(seq)
            return _NO_BLOCKS
        if not resumed:
            self.kv.record_prefix_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        step.add(seq, num_new)
        return _ADMITTED

    def on_step_done(
        self, output: SchedulerOutput, sampled: dict[int, list[int]] | None = None
    ) -> dict[int, int]:
        """Account for the tokens the step computed and publish completed blocks for reuse.

        A sequence that verified drafts counts only its last real token as computed here and gives
        up the blocks past the ones its kept tokens need; each kept draft counts as computed when
        the engine appends it (`draft_kept`). `sampled`: seq_id -> the tokens sampled at each of
        its positions (needed for the sequences that drafted). Returns seq_id -> kept drafts."""
        kept: dict[int, int] = {}
        for seq, num_new in output.scheduled:
            if seq.status != SequenceStatus.RUNNING:
                continue
            if seq.num_draft_tokens:
                draft = seq.discard_draft()
                accepted = accepted_prefix(draft, sampled[seq.seq_id])
                self.speculator.record(seq, len(draft), accepted)
                kept[seq.seq_id] = accepted
                num_new = 1
                self.kv.trim(seq, seq.num_tokens + accepted + 1)
            seq.num_computed_tokens += num_new
            self.kv.register_computed_blocks(seq)
        return kept

    def draft_kept(self, seq: Sequence) -> None:
        """A verified draft was appended (and did not end the sequence): its KV is in the cache."""
        seq.num_computed_tokens += 1
        self.kv.register_computed_blocks(seq)
