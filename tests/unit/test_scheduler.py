"""The scheduler on plain Sequences (no model): step order, token budget, priorities, preemption."""

from __future__ import annotations

import itertools

from libs.engine import SamplingParams, SchedulerConfig
from libs.engine.block_manager import KVCacheManager
from libs.engine.scheduler import Scheduler, SchedulerOutput
from libs.engine.sequence import Sequence, SequenceStatus
from tests.helpers.clock import ManualClock

BS = 4  # tokens per block
_tokens = itertools.count(1000)  # distinct token ids, so that no two prompts share a prefix by accident


def scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 8,
    budget: int = 64,
    aging_seconds: float = 0.0,
    clock: ManualClock | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, aging_seconds=aging_seconds
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, watermark=0), clock=clock or ManualClock())


def seq(num_tokens: int, *, priority: int = 0, arrival: float = 0.0, tokens: list[int] | None = None):
    prompt = tokens if tokens is not None else [next(_tokens) for _ in range(num_tokens)]
    return Sequence("r", prompt, SamplingParams(), request_seed=0, priority=priority, arrival_time=arrival)


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, account, append a token where one is sampled."""
    plan = s.schedule()
    s.on_step_done(plan)
    for sq, _ in plan.scheduled:
        if sq.status == SequenceStatus.RUNNING and sq.num_computed_tokens == sq.num_tokens:
            sq.append_token(7)
    return plan


def work(plan: SchedulerOutput) -> list[tuple[Sequence, int]]:
    return [(sq, n) for sq, n in plan.scheduled]


# -- order and budget -----------------------------------------------------------------------------


def test_a_prompt_that_fits_is_admitted_and_prefilled_in_one_step():
    s = scheduler()
    a = seq(10)
    s.add(a)
    assert work(step(s)) == [(a, 10)]
    assert a.status == SequenceStatus.RUNNING and a.num_computed_tokens == 10
    assert work(step(s)) == [(a, 1)]


def test_a_long_prompt_is_chunked_by_the_token_budget():
    s = scheduler(budget=16)
    a = seq(50)
    s.add(a)
    chunks = [work(step(s))[0][1] for _ in range(5)]
    assert chunks == [16, 16, 16, 2, 1]


def test_decodes_are_scheduled_before_prefills():
    s = scheduler(budget=16)
    a, b = seq(4, priority=0), seq(40, priority=5, arrival=1.0)
    s.add(a)
    step(s)  # a prefilled, now decoding
    s.add(b)
    assert work(step(s)) == [(a, 1), (b, 15)]
    assert work(step(s)) == [(a, 1), (b, 15)]  # b is mid-prompt, still after the decode


def test_a_step_never_exceeds_the_token_budget():
    s = scheduler(budget=24, num_blocks=200)
    for i, n in enumerate((30, 5, 17, 60, 2, 9)):
        s.add(seq(n, arrival=float(i)))
    for _ in range(20):
        assert step(s).num_batched_tokens <= 24


def test_waiting_sequences_share_what_the_budget_leaves():
    s = scheduler(budget=20)
    a, b, c = seq(8), seq(8, arrival=1.0), seq(8, arrival=2.0)
    for x in (a, b, c):
        s.add(x)
    assert work(step(s)) == [(a, 8), (b, 8), (c, 4)]
    assert work(step(s)) == [(a, 1), (b, 1), (c, 4)]


def test_max_num_seqs_caps_the_running_set():
    s = scheduler(max_num_seqs=2)
    seqs = [seq(4, arrival=float(i)) for i in range(5)]
    for x in seqs:
        s.add(x)
    for _ in range(3):
        step(s)
        assert s.num_running == 2 and s.num_waiting == 3
    s.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    plan = step(s)
    assert s.num_running == 2
    assert (seqs[2], 4) in work(plan)


def test_finish_frees_the_blocks_and_forgets_the_sequence():
    s = scheduler()
    a = seq(10)
    s.add(a)
    step(s)
    s.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.block_table == []
    assert s.kv.pool.num_allocatable_blocks == s.kv.pool.num_usable_blocks
    assert not s.has_unfinished()
    assert step(s).is_empty


# -- priorities -----------------------------------------------------------------------------------


def test_the_highest_priority_waiting_sequence_is_admitted_first():
    s = scheduler(max_num_seqs=1)
    low, high, mid = seq(4, priority=0), seq(4, priority=2, arrival=1.0), seq(4, priority=1, arrival=2.0)
    for x in (low, high, mid):
        s.add(x)
    assert work(step(s)) == [(high, 4)]


def test_equal_priorities_are_served_in_arrival_order():
    s = scheduler(max_num_seqs=1)
    late, early = seq(4, arrival=5.0), seq(4, arrival=1.0)
    s.add(late)
    s.add(early)
    assert work(step(s)) == [(early, 4)]


def test_a_prompt_that_does_not_fit_holds_back_the_queue_behind_it():
    s = scheduler(num_blocks=9)  # 8 usable blocks
    a = seq(16)
    s.add(a)
    step(s)  # a holds 4 blocks (5 once it decodes)
    big, small = seq(20, arrival=1.0), seq(4, arrival=2.0)  # big needs 5 blocks, small 1
    s.add(big)
    s.add(small)
    plan = step(s)
    assert work(plan) == [(a, 1)]
    assert big.status == small.status == SequenceStatus.WAITING
    s.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert work(step(s)) == [(big, 20), (small, 4)]


def test_aging_lets_a_long_waiting_low_priority_sequence_go_first():
    clock = ManualClock()
    s = scheduler(max_num_seqs=1, aging_seconds=1.0, clock=clock)
    low, high = seq(4, priority=0, arrival=0.0), seq(4, priority=3, arrival=9.0)
    s.add(low)
    s.add(high)
    clock.now = 10.0  # low: 0 + 10 / 1 = 10; high: 3 + 1 / 1 = 4
    assert work(step(s)) == [(low, 4)]


def test_without_aging_priority_alone_decides():
    clock = ManualClock()
    s = scheduler(max_num_seqs=1, aging_seconds=0.0, clock=clock)
    low, high = seq(4, priority=0, arrival=0.0), seq(4, priority=3, arrival=9.0)
    s.add(low)
    s.add(high)
    clock.now = 1000.0
    assert work(step(s)) == [(high, 4)]


def test_a_waiting_sequence_preempts_a_running_one_of_strictly_lower_priority():
    s = scheduler(max_num_seqs=1)
    low = seq(4, priority=0)
    s.add(low)
    step(s)
    high = seq(4, priority=1, arrival=1.0)
    s.add(high)
    plan = step(s)
    assert work(plan) == [(high, 4)]
    assert plan.preempted == [low] and low.status == SequenceStatus.WAITING


def test_a_waiting_sequence_never_preempts_an_equal_priority_one():
    s = scheduler(max_num_seqs=1)
    first = seq(4, priority=1)
    s.add(first)
    step(s)
    second = seq(4, priority=1, arrival=1.0)
    s.add(second)
    plan = step(s)
    assert work(plan) == [(first, 1)] and plan.preempted == []


# -- preemption -----------------------------------------------------------------------------------


def _three_full_blocks(s: Scheduler, *specs: tuple[int, float]) -> list[Sequence]:
    """Admit one single-block sequence per (priority, arrival) and prefill it; the pool is then full."""
    seqs = [seq(BS, priority=p, arrival=t) for p, t in specs]
    for x in seqs:
        s.add(x)
    step(s)
    assert s.kv.pool.num_allocatable_blocks == 0
    return seqs


def test_the_victim_is_the_lowest_priority_then_the_latest_arrival():
    s = scheduler(num_blocks=4)  # 3 usable blocks
    high, early_low, late_low = _three_full_blocks(s, (1, 0.0), (0, 1.0), (0, 2.0))
    plan = step(s)  # everyone needs a second block; none is free
    assert plan.preempted[0] is late_low
    assert plan.preempted == [late_low, early_low]
    assert work(plan) == [(high, 1)]


def test_a_preempted_sequence_waits_to_be_recomputed_from_its_tokens():
    s = scheduler(num_blocks=4)
    _, _, victim = _three_full_blocks(s, (1, 0.0), (0, 1.0), (0, 2.0))
    tokens = list(victim.token_ids)
    step(s)
    assert victim.status == SequenceStatus.WAITING and victim in s.waiting
    assert victim.num_computed_tokens == 0 and victim.block_table == []
    assert victim.num_preemptions == 1 and victim.token_ids == tokens
    assert s.num_preemptions_total == 2


def test_nothing_is_admitted_in_a_step_that_preempted():
    s = scheduler(num_blocks=4)
    high, _, _ = _three_full_blocks(s, (1, 0.0), (0, 1.0), (0, 2.0))
    newcomer = seq(1, priority=5, arrival=3.0)
    s.add(newcomer)
    plan = step(s)
    assert plan.preempted
    assert newcomer.status == SequenceStatus.WAITING
    assert [x for x, _ in work(plan)] == [high]


def test_a_victim_already_scheduled_this_step_gives_its_tokens_back():
    s = scheduler(num_blocks=4, budget=32)  # 3 usable blocks
    decoding = seq(BS, priority=0)
    s.add(decoding)
    step(s)  # 1 block, now decoding: its next token needs a second block
    prefilling = seq(12, priority=1, arrival=1.0)
    s.kv.allocate_slots(prefilling, 4)  # mid-prompt, admitted earlier: holds 1 block, needs 2 more
    prefilling.num_computed_tokens = 4
    prefilling.status = SequenceStatus.RUNNING
    s.running.append(prefilling)
    plan = step(s)
    assert plan.preempted == [decoding]
    assert work(plan) == [(prefilling, 8)]


def test_a_sequence_that_cannot_get_a_block_preempts_itself_when_least_important():
    s = scheduler(num_blocks=3)  # 2 usable blocks
    important, least = _three_full_blocks(s, (1, 0.0), (0, 1.0))
    plan = step(s)
    assert plan.preempted == [least]
    assert work(plan) == [(important, 1)]


# -- the prefix cache at admission ----------------------------------------------------------------


def test_an_admitted_sequence_starts_after_its_cached_prefix():
    s = scheduler()
    prefix = [next(_tokens) for _ in range(3 * BS)]
    first = seq(0, tokens=[*prefix, 1, 2])
    s.add(first)
    step(s)
    second = seq(0, tokens=[*prefix, 3], arrival=1.0)
    s.add(second)
    plan = step(s)
    assert (second, 1) in work(plan)
    assert second.num_cached_tokens == 3 * BS
    assert second.block_table[:3] == first.block_table[:3]


def test_admission_counts_prefix_cache_queries_and_hits():
    s = scheduler()
    prefix = [next(_tokens) for _ in range(2 * BS)]
    s.add(seq(0, tokens=[*prefix, 1, 2]))  # 10 tokens asked, 0 found
    step(s)
    s.add(seq(0, tokens=[*prefix, 3, 4, 5], arrival=1.0))  # 11 asked, 8 found
    step(s)
    usage = s.kv.usage()
    assert (usage.prefix_queries, usage.prefix_hits) == (21, 8)


def test_a_fork_runs_on_its_parent_blocks():
    s = scheduler()
    parent = seq(6)
    s.add(parent)
    step(s)
    child = parent.fork(1)
    s.add_fork(parent, child)
    assert child.status == SequenceStatus.RUNNING and child.block_table == parent.block_table
    plan = step(s)
    assert {x.seq_id for x, _ in work(plan)} == {parent.seq_id, child.seq_id}
    assert len(plan.blocks_to_copy) == 1  # the shared, partly filled block is copied once
