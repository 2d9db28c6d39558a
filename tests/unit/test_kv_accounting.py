"""KV accounting under random traffic: the block pool's counts (used + cached + free = all blocks)
against a recount from the block tables themselves, after every step of random sequences of
requests, session turns (kept, adopted, diverged, ended, evicted), n > 1 forks with copy-on-write,
prefix-cache hits, preemption and aborts. The scheduler, session table and KV manager are driven
the way LLMEngine drives them (enqueue, step, fork after the first sample, abort, end_session),
without a model: each step appends a drawn token to every sequence that sampled.

Issue 34: after first turns of 256 sessions sharing a system prompt, the engine reported more free
blocks than it had, counting a shared block once per session that kept it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from libs.engine import SamplingParams, SchedulerConfig
from libs.engine.block_manager import NULL_BLOCK, KVCacheManager
from libs.engine.scheduler import Scheduler
from libs.engine.sequence import Sequence, SequenceStatus
from libs.engine.sessions import SessionError, SessionRef, SessionTable

BS = 4  # tokens per block
NUM_BLOCKS = 24  # 23 usable: small enough that traffic preempts and evicts
SYSTEM_PROMPTS = ([1, 2, 3, 1, 2, 3, 1, 2], [3, 2, 1, 3, 2, 1, 3, 2, 1], [])  # shared prefixes
SESSIONS = ("a", "b", "c", "d")  # one more than the table holds


@dataclass
class Turn:
    """A request in flight: its sequences (forks join after the first sample) and output budget."""

    request_id: str
    seqs: list[Sequence]
    max_tokens: int
    session_id: str | None = None
    done: set[int] = field(default_factory=set)


class KVTraffic(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, watermark=0.05)
        self.sessions = SessionTable(self.kv, max_sessions=len(SESSIONS) - 1)
        config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, aging_seconds=0.0)
        self.scheduler = Scheduler(config, self.kv, clock=lambda: 0.0, sessions=self.sessions)
        self.turns: dict[str, Turn] = {}
        self.history: dict[str, list[int]] = {}  # each session's tokens after its last turn
        self.ids = itertools.count()

    # -- traffic ------------------------------------------------------------------------------

    @rule(
        system=st.sampled_from(SYSTEM_PROMPTS),
        own=st.lists(st.integers(1, 3), min_size=1, max_size=9),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 1),
    )
    def request(self, system, own, n, max_tokens, priority):
        self._enqueue(system + own, n, max_tokens, priority, None)

    @rule(
        session_id=st.sampled_from(SESSIONS),
        new=st.lists(st.integers(1, 3), min_size=1, max_size=6),
        continues=st.booleans(),
        n=st.integers(1, 2),
        max_tokens=st.integers(1, 6),
    )
    def session_turn(self, session_id, new, continues, n, max_tokens):
        """The session's history and new tokens (or a diverged prompt, which recomputes)."""
        history = self.history.get(session_id, []) if continues else SYSTEM_PROMPTS[0]
        if len(history) + len(new) + max_tokens > 40:  # a full session is ended and started anew
            self._end_session(session_id)
            history = SYSTEM_PROMPTS[0]
        self._enqueue(history + new, n, max_tokens, 0, session_id)

    @rule(token=st.integers(1, 3))
    def step(self, token):
        plan = self.scheduler.schedule()
        self.scheduler.on_step_done(plan)
        for seq, _ in plan.scheduled:
            if seq.status == SequenceStatus.RUNNING and seq.num_computed_tokens == seq.num_tokens:
                self._sample(seq, token)

    @precondition(lambda self: self.turns)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.turns)))
        self._abort(request_id)

    @rule(session_id=st.sampled_from(SESSIONS))
    def end_session(self, session_id):
        self._end_session(session_id)

    @rule()
    def evict_idle_session(self):
        self.sessions.evict_one()

    # -- the engine's moves -------------------------------------------------------------------

    def _enqueue(self, prompt, n, max_tokens, priority, session_id):
        request_id = f"r{next(self.ids)}"
        params = SamplingParams(n=n, max_tokens=max_tokens)
        seq = Sequence(request_id, prompt, params, request_seed=0, priority=priority)
        if session_id is not None:
            try:
                self.sessions.begin_turn(seq, SessionRef(session_id, history_tokens=len(prompt) - 1))
            except SessionError:  # busy, or the table is full: the engine refuses the turn
                return
        self.turns[request_id] = Turn(request_id, [seq], max_tokens, session_id)
        self.scheduler.add(seq)

    def _sample(self, seq: Sequence, token: int) -> None:
        turn = self.turns[seq.request_id]
        targets = [seq]
        if seq.num_pending_forks > 1:  # the first sample of an n > 1 request forks the others
            forks = seq.num_pending_forks
            seq.num_pending_forks = 1
            for index in range(1, forks):
                child = seq.fork(index)
                self.scheduler.add_fork(seq, child)
                turn.seqs.append(child)
                targets.append(child)
        for target in targets:
            target.append_token(token)
            if target.num_output_tokens >= turn.max_tokens:
                self._finish(turn, target, SequenceStatus.FINISHED_LENGTH)

    def _finish(self, turn: Turn, seq: Sequence, status: SequenceStatus) -> None:
        if turn.session_id is not None and seq.index == 0:
            self.history[turn.session_id] = list(seq.token_ids)
        self.scheduler.finish(seq, status)
        turn.done.add(seq.seq_id)
        if len(turn.done) == len(turn.seqs):
            del self.turns[turn.request_id]

    def _abort(self, request_id: str) -> None:
        turn = self.turns[request_id]
        for seq in list(turn.seqs):
            if seq.seq_id not in turn.done:
                self._finish(turn, seq, SequenceStatus.FINISHED_ABORTED)

    def _end_session(self, session_id: str) -> None:
        active = self.sessions.active_request(session_id)
        if self.sessions.end(session_id):
            self.history.pop(session_id, None)
            if active is not None:
                self._abort(active)

    # -- the invariant ------------------------------------------------------------------------

    @invariant()
    def counts_partition_the_pool_and_match_the_block_tables(self):
        live = [s for s in self.scheduler.running + self.scheduler.waiting]
        parked = [s.parked for s in self.sessions._sessions.values() if s.parked is not None]
        live_refs = Counter(b for s in live for b in s.block_table)
        kept_refs = Counter(b for s in parked for b in s.block_table)
        pool = self.kv.pool
        for block in pool.blocks[NULL_BLOCK + 1 :]:
            assert block.ref_cnt == live_refs[block.block_id] + kept_refs[block.block_id], block
            assert block.kept_cnt == kept_refs[block.block_id], block
        used = set(live_refs)
        kept_only = set(kept_refs) - used
        unreferenced = [b for b in pool.blocks[NULL_BLOCK + 1 :] if b.ref_cnt == 0]
        prefixes = sum(1 for b in unreferenced if b.block_hash is not None)

        usage = self.kv.usage()
        assert usage.num_used_blocks + usage.num_cached_blocks + usage.num_free_blocks == usage.num_blocks
        assert usage.num_used_blocks == len(used)
        assert usage.num_session_blocks == len(kept_only)
        assert usage.num_cached_blocks == len(kept_only) + prefixes
        assert usage.num_free_blocks == len(unreferenced) - prefixes
        assert pool.num_allocatable_blocks == len(unreferenced)


TestKVTraffic = KVTraffic.TestCase
TestKVTraffic.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
