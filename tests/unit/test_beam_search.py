"""Beam search without a model: the scoring rules (transformers'), the forks and frees it makes of
real engine sequences through a real Scheduler and KVCacheManager (copy-on-write of one block),
and the refusals of SamplingParams and of reception's validation."""

from __future__ import annotations

import pytest

from libs.engine import SamplingParams
from libs.engine.beam_search import BeamDriver, BeamSearch
from libs.engine.block_manager import KVCacheManager
from libs.engine.config import SchedulerConfig
from libs.engine.errors import InvalidRequestError
from libs.engine.scheduler import Scheduler
from libs.engine.sequence import Sequence
from libs.gen.expert.v1 import common_pb2
from services.reception.admission.beams import beam_problems

EOS = 2
BS = 4  # tokens per KV block


def _search(width: int = 2, max_new: int = 8, **kw) -> BeamSearch:
    search = BeamSearch(width=width, max_new_tokens=max_new, end_ids=frozenset({EOS}), **kw)
    search.start(100)
    return search


def _step(search: BeamSearch, offers: dict[int, list[tuple[int, float]]]) -> list:
    """One step with the given offers per running beam (by position); the new running beams get
    seq ids 200, 201, ... as a driver would give them."""
    for beam, top in zip(search.running, offers.values(), strict=True):
        search.offer(beam.seq_id, top)
    beams = search.advance()
    for i, beam in enumerate(beams):
        beam.seq_id = 200 + i + 10 * len(beam.token_ids)
    search.running = beams
    return beams


def test_the_first_step_takes_the_best_continuations_of_the_prompt():
    search = _search(width=2)
    beams = _step(search, {0: [(5, -0.1), (6, -0.5), (7, -1.0), (8, -2.0)]})
    assert [(b.token_ids, float(b.logprob)) for b in beams] == [
        ([5], pytest.approx(-0.1)),
        ([6], pytest.approx(-0.5)),
    ]
    assert not search.done and search.finished == []


def test_an_end_token_in_the_first_width_is_a_hypothesis_scored_with_the_length_penalty():
    search = _search(width=2, length_penalty=2.0)
    _step(search, {0: [(5, -0.1), (6, -0.5), (7, -1.0), (8, -2.0)]})
    beams = _step(search, {0: [(EOS, -0.2), (9, -0.3), (10, -3.0), (11, -4.0)], 1: [(12, -0.1), (13, -5.0)]})
    (hyp,) = search.finished
    assert hyp.token_ids == [5, EOS] and hyp.finish_reason == "stop"
    assert hyp.cumulative_logprob == pytest.approx(-0.3)
    assert hyp.score == pytest.approx(-0.3 / 2**2.0)
    # The ended continuation does not run on; the next best ones do, across both beams.
    assert [b.token_ids for b in beams] == [[5, 9], [6, 12]]


def test_an_end_token_ranked_past_the_width_is_dropped():
    search = _search(width=2)
    _step(search, {0: [(5, -0.1), (6, -0.2), (7, -1.0), (8, -2.0)]})
    _step(search, {0: [(9, -0.1), (10, -0.2), (EOS, -0.3), (11, -4.0)], 1: [(12, -3.0), (13, -5.0)]})
    assert search.finished == []


def test_max_tokens_ends_the_search_with_the_best_width_continuations():
    search = _search(width=2, max_new=2)
    _step(search, {0: [(5, -0.1), (6, -0.2), (7, -1.0), (8, -2.0)]})
    assert _step(search, {0: [(9, -0.5), (10, -0.6)], 1: [(11, -0.1), (12, -0.7)]}) == []
    assert search.done
    assert [h.token_ids for h in search.best(2)] == [[6, 11], [5, 9]]
    assert {h.finish_reason for h in search.finished} == {"length"}


def test_early_stopping_true_stops_at_width_hypotheses_false_goes_on_while_a_beam_can_win():
    offers = [
        {0: [(5, -0.1), (EOS, -0.5), (6, -0.6), (7, -1.0)]},  # [EOS] ends: -0.5 / 1
        {0: [(EOS, -0.2), (9, -0.8)], 1: [(12, -0.5), (13, -1.0)]},  # [5, EOS] ends: -0.3 / 2
    ]
    eager, heuristic = _search(width=2, early_stopping=True), _search(width=2, early_stopping=False)
    for search in (eager, heuristic):
        for step in offers:
            _step(search, step)
        assert [h.score for h in search.finished] == [pytest.approx(-0.15), pytest.approx(-0.5)]
    assert eager.done
    # The best running beam [5, 9] scores -0.9 / 2 = -0.45 at its length: it can still beat -0.5.
    assert not heuristic.done


@pytest.mark.parametrize(("early_stopping", "done"), [("never", False), (False, True)])
def test_never_with_a_positive_penalty_judges_a_beam_at_max_tokens(early_stopping, done):
    search = _search(width=2, max_new=6, early_stopping=early_stopping, length_penalty=1.0)
    _step(search, {0: [(5, -0.1), (6, -0.2), (7, -1.0), (8, -2.0)]})
    _step(search, {0: [(EOS, -0.1), (9, -0.25)], 1: [(EOS, -0.05), (12, -0.3)]})
    assert len(search.finished) == 2  # -0.2 / 2 and -0.25 / 2
    # The best running beam, -0.35: over 6 tokens (never) it beats -0.125, over 2 it does not.
    assert search.done is done


# -- the driver on real sequences, scheduler and block manager -----------------------------------


def _engine_parts(blocks: int = 32) -> tuple[KVCacheManager, Scheduler, dict[int, Sequence], BeamDriver]:
    kv = KVCacheManager(blocks, BS, watermark=0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    seqs: dict[int, Sequence] = {}
    return kv, scheduler, seqs, BeamDriver(scheduler.add_fork, scheduler.finish, seqs)


def _run_step(scheduler: Scheduler):
    """Schedule a step and mark it computed (no model: the decisions are the test's)."""
    plan = scheduler.schedule()
    scheduler.on_step_done(plan)
    return plan


def test_forked_beams_share_blocks_and_each_write_copies_only_the_last_block():
    kv, scheduler, seqs, driver = _engine_parts()
    params = SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=8)
    first = Sequence("r", list(range(10, 16)), params, request_seed=0)  # 6 tokens: 1 full block + 2
    seqs[first.seq_id] = first
    search = BeamSearch(width=3, max_new_tokens=8, end_ids=frozenset({EOS}))
    search.start(first.seq_id)
    scheduler.add(first)
    _run_step(scheduler)
    assert len(first.block_table) == 2

    driver.on_sample(search, first, [(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4), (9, -0.5), (3, -0.6)])
    beams = [seqs[b.seq_id] for b in search.running]
    assert [s.output_token_ids for s in beams] == [[5], [6], [7]]
    assert all(s.block_table == first.block_table for s in beams)  # forks share every block
    full, partial = first.block_table
    assert kv.pool.blocks[full].ref_cnt == kv.pool.blocks[partial].ref_cnt == 3

    plan = _run_step(scheduler)  # each beam writes its new token into the shared partial block
    assert all(src == partial for src, _ in plan.blocks_to_copy)
    assert len(plan.blocks_to_copy) == 2  # the third writer holds the last reference: no copy
    assert kv.pool.blocks[full].ref_cnt == 3  # the full block stays shared
    assert len({s.block_table[1] for s in beams}) == 3

    # Next: beam 0 continues twice, beam 1 once, beam 2 not at all (its blocks are freed).
    before = kv.usage().num_free_blocks
    driver.on_sample(search, beams[0], [(20, -0.1), (21, -0.2), (22, -5.0)])
    driver.on_sample(search, beams[1], [(23, -0.1), (24, -5.0)])
    driver.on_sample(search, beams[2], [(25, -5.0), (26, -6.0)])
    assert beams[2].seq_id not in seqs and beams[2].block_table == []
    assert kv.usage().num_free_blocks == before + 1  # only its private copy comes back
    assert sorted(seqs[b.seq_id].output_token_ids for b in search.running) == [[5, 20], [5, 21], [6, 23]]


def test_aborting_a_beam_search_frees_every_beam():
    kv, scheduler, seqs, driver = _engine_parts()
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    first = Sequence("r", list(range(10, 15)), params, request_seed=0)
    seqs[first.seq_id] = first
    search = BeamSearch(width=2, max_new_tokens=8, end_ids=frozenset({EOS}))
    search.start(first.seq_id)
    scheduler.add(first)
    _run_step(scheduler)
    driver.on_sample(search, first, [(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)])
    driver.abort(search)
    assert search.done and seqs == {} and kv.usage().num_used_blocks == 0
    assert [h.finish_reason for h in search.best(2)] == ["abort", "abort"]


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"use_beam_search": True, "temperature": 0.0}, "best_of"),  # one beam
        ({"use_beam_search": True, "n": 2}, "temperature"),  # the default temperature samples
        ({"use_beam_search": True, "n": 2, "temperature": 0.0, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.0, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.0, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.0, "speculative": True}, "speculative"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.0, "early_stopping": "soon"}, "early_stopping"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.0, "length_penalty": 11.0}, "length_penalty"),
        ({"length_penalty": 2.0}, "length_penalty"),  # only with beams
        ({"early_stopping": True}, "early_stopping"),
    ],
)
def test_sampling_params_refuse_by_name(fields, name):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    assert info.value.field == name


def test_beam_search_turns_speculation_off_and_counts_its_beams():
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0.0)
    assert params.speculative is False and params.num_seqs == 4 and not params.ranks_outputs
    assert SamplingParams(n=2, best_of=3, temperature=1.0).ranks_outputs


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"n": 3, "best_of": 2}, ["request.best_of"]),
        ({"best_of": 17}, ["request.best_of"]),
        ({"use_beam_search": True}, ["request.best_of"]),
        (
            {"use_beam_search": True, "n": 2, "temperature": 0.7, "top_k": 5, "stop": ["."]},
            ["request.temperature", "request.top_k", "request.stop"],
        ),
        (
            {"length_penalty": 0.5, "early_stopping": "true"},
            ["request.length_penalty", "request.early_stopping"],
        ),
        ({"use_beam_search": True, "n": 2, "early_stopping": "maybe"}, ["request.early_stopping"]),
    ],
)
def test_reception_names_every_beam_problem(fields, names):
    request = common_pb2.InferenceRequest(prompt="hi", **fields)
    assert [field for field, _ in beam_problems(request)] == names


def test_reception_accepts_beams_with_neutral_values():
    request = common_pb2.InferenceRequest(
        prompt="hi", n=2, best_of=4, use_beam_search=True, temperature=0.0, top_p=1.0, early_stopping="never"
    )
    assert beam_problems(request) == []


def test_the_sdk_sends_early_stopping_as_the_protos_text():
    from expert_system.request import build_request

    assert build_request("infer", "hi", {"early_stopping": True}).early_stopping == "true"
    assert build_request("infer", "hi", {"early_stopping": "never"}).early_stopping == "never"


def test_the_router_neutralises_its_tuned_sampling_for_beams():
    from services.router.planner import copy_beam_search

    params = common_pb2.GenerationParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1, n=2)
    trace: list[str] = []
    request = common_pb2.InferenceRequest(
        prompt="hi", n=2, best_of=3, use_beam_search=True, early_stopping="true"
    )
    copy_beam_search(request, params, trace)
    assert (params.best_of, params.use_beam_search, params.early_stopping) == (3, True, "true")
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.0, 1.0, 1.0)
    assert not params.HasField("length_penalty") and trace
    sampled = common_pb2.GenerationParams(temperature=0.6)
    copy_beam_search(common_pb2.InferenceRequest(prompt="hi", n=1, best_of=2), sampled, [])
    assert (sampled.best_of, sampled.use_beam_search, sampled.temperature) == (2, False, pytest.approx(0.6))


def test_the_rest_body_carries_early_stopping_as_the_protos_text():
    from services.reception.http.rest import to_request
    from services.reception.http.rest_schema import JobBody

    body = JobBody(
        prompt="hi", n=2, best_of=3, use_beam_search=True, length_penalty=0.5, early_stopping=False
    )
    request = to_request(body)
    assert (request.best_of, request.use_beam_search, request.early_stopping) == (3, True, "false")
    assert request.length_penalty == 0.5
    assert to_request(JobBody(prompt="hi", early_stopping="never")).early_stopping == "never"


def test_the_openai_chat_body_maps_beams_as_the_completions_body_does():
    from services.reception.http.openai_request import to_request
    from services.reception.http.openai_schema import ChatCompletionRequest, CompletionRequest

    fields = {"model": "m", "n": 2, "best_of": 3, "use_beam_search": True, "length_penalty": 0.5}
    chat = to_request(
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields, early_stopping=True)
    )
    completion = to_request(CompletionRequest(prompt="hi", **fields, early_stopping=True))
    beams = ("best_of", "use_beam_search", "length_penalty", "early_stopping")
    assert (
        [getattr(chat, f) for f in beams] == [getattr(completion, f) for f in beams] == [3, True, 0.5, "true"]
    )
    unset = to_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert not any(unset.HasField(f) for f in ("best_of", "length_penalty", "early_stopping"))
    assert not unset.use_beam_search
