"""Token-budget continuous batching with chunked prefill, priorities with aging, and preemption.

Each step gets a budget of tokens. Running sequences that are decoding go first (one token each),
then running sequences in the middle of a prompt (a chunk each, as much as the budget leaves), then
waiting sequences in priority order, a chunk each. So a long prompt is spread over several steps
and never holds back the running decodes. When a running sequence needs a block and the pool is
empty, the least important running sequence (lowest effective priority, then latest arrival) is
preempted: its blocks are freed and it goes back to waiting, to be recomputed later from its
tokens (which the prefix cache often makes cheap). Effective priority = priority + seconds
waited / aging_seconds, so nothing starves. Higher priority values are more important.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.block_manager import KVCacheManager
from services.engine.config import SchedulerConfig
from services.engine.sequence import Sequence, SequenceStatus


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


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
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
        """A running sequence's sibling, sharing its blocks."""
        self.kv.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (stopped, length, aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status

    def _importance(self, now: float) -> Callable[[Sequence], tuple[float, float, int]]:
        aging = self.config.aging_seconds

        def key(seq: Sequence) -> tuple[float, float, int]:
            boost = (now - seq.arrival_time) / aging if aging > 0 else 0.0
            # Most important first: higher effective priority, then earlier arrival.
            return (-(seq.priority + boost), seq.arrival_time, seq.seq_id)

        return key

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_preemptions_total += 1

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget; may preempt to make room."""
        key = self._importance(self.clock())
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, tuple[Sequence, int]] = {}
        preempted: list[Sequence] = []

        ordered = sorted(self.running, key=key)
        decoding = [s for s in ordered if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in ordered if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = max(self.running, key=key)
                self._preempt(victim)
                preempted.append(victim)
                if victim.seq_id in scheduled:
                    budget += scheduled.pop(victim.seq_id)[1]
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = (seq, num_new)
                budget -= num_new

        if not preempted:
            self._admit(key, budget, scheduled)
        return SchedulerOutput(list(scheduled.values()), self.kv.take_copies(), preempted)

    def _admit(
        self,
        key: Callable[[Sequence], tuple[float, float, int]],
        budget: int,
        scheduled: dict[int, tuple[Sequence, int]],
    ) -> None:
        """Move waiting sequences to running, most important first, while budget and blocks last."""
        self.waiting.sort(key=key)
        admitted = 0
        for seq in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, num_new, cached, keep_watermark=True):
                break  # strict priority order: nothing behind it jumps the queue
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = (seq, num_new)
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

    def on_step_done(self, output: SchedulerOutput) -> None:
        """Account for the tokens the step computed and publish completed blocks for reuse."""
        for seq, num_new in output.scheduled:
            if seq.status == SequenceStatus.RUNNING:
                seq.num_computed_tokens += num_new
                self.kv.register_computed_blocks(seq)
