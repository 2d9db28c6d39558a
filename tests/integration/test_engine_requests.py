"""The request API of LLMEngine on a tiny real model: validation that leaves the engine untouched,
abort, mixed prompts, per-request metrics, engine statistics and priorities."""

from __future__ import annotations

import pytest
import torch

from libs.engine import InvalidRequestError, LLMEngine, SamplingParams

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_blocks=64)


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_free_blocks == stats.kv_num_blocks and stats.kv_used_blocks == 0


def run_to_completion(engine: LLMEngine) -> list[str]:
    """Step until idle; the request ids in the order they finished."""
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    return finished


def _tokens(engine: LLMEngine, n: int, offset: int = 0) -> list[int]:
    vocab = engine.model_config.vocab_size
    return [3 + (offset * 37 + i * 11) % (vocab - 3) for i in range(n)]


# -- validation -----------------------------------------------------------------------------------


# case -> (prompt and add_request keywords for a vocabulary size, the field the error must name)
INVALID = {
    "empty text": (lambda v: ("", {}), "prompt"),
    "empty token list": (lambda v: ([], {}), "prompt"),
    "no prompt": (lambda v: (None, {}), "prompt"),
    "a number": (lambda v: (42, {}), "prompt"),
    "token id = vocab": (lambda v: ([1, 2, v], {}), "prompt_token_ids[2]"),
    "negative token id": (lambda v: ([1, -1], {}), "prompt_token_ids[1]"),
    "a bool token": (lambda v: ([1, True], {}), "prompt_token_ids[1]"),
    "a text token": (lambda v: ([1, "a"], {}), "prompt_token_ids[1]"),
    "prompt as long as max_model_len": (lambda v: ([5] * MAX_MODEL_LEN, {}), "prompt"),
    "prompt + max_tokens too long": (
        lambda v: ([5] * 60, {"params": SamplingParams(max_tokens=5)}),
        "max_tokens",
    ),
    "stop id beyond the vocabulary": (
        lambda v: ([5], {"params": SamplingParams(stop_token_ids=[1, v])}),
        "stop_token_ids[1]",
    ),
    "unknown role": (lambda v: ([{"role": "wizard", "content": "hi"}], {}), "messages[0].role"),
    "message without content": (
        lambda v: ([{"role": "user", "content": "a"}, {"role": "user"}], {}),
        "messages[1].content",
    ),
    "priority is text": (lambda v: ("Hello", {"priority": "high"}), "priority"),
    "priority is a float": (lambda v: ("Hello", {"priority": 1.5}), "priority"),
    "priority is a bool": (lambda v: ("Hello", {"priority": True}), "priority"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_an_invalid_request_is_refused_naming_the_field_and_changes_nothing(engine, case):
    build, field = INVALID[case]
    prompt, extra = build(engine.model_config.vocab_size)
    before = engine.get_stats()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(f"invalid-{case}", prompt, **extra)
    assert info.value.field == field
    assert_idle(engine)
    assert engine.get_stats() == before


@pytest.mark.parametrize("request_id", ["", 7, None])
def test_a_request_id_must_be_a_non_empty_string(engine, request_id):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request_id, "Hello")
    assert info.value.field == "request_id"
    assert_idle(engine)


def test_a_sequence_that_could_never_fit_the_kv_pool_is_refused(tiny_llama):
    small = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_blocks=3)  # 32 tokens
    for params in (SamplingParams(max_tokens=30), SamplingParams(max_tokens=None)):
        with pytest.raises(InvalidRequestError) as info:
            small.add_request("too-big", [5] * 10, params)
        assert info.value.field == "max_tokens"
        assert_idle(small)
    small.add_request("fits", [5] * 10, SamplingParams(max_tokens=22, ignore_eos=True))
    assert run_to_completion(small) == ["fits"]


@pytest.mark.parametrize("dtype", [torch.float32, "float32", "float"])
def test_from_pretrained_takes_a_torch_dtype_or_its_name(tiny_llama, engine, dtype):
    built = LLMEngine.from_pretrained(
        str(tiny_llama), dtype=dtype, max_model_len=MAX_MODEL_LEN, num_blocks=64
    )
    assert (built.dtype, built.config.dtype, built.kernels) == (torch.float32, "float32", engine.kernels)
    assert built.generate(["Hello"], GREEDY)[0].token_ids == engine.generate(["Hello"], GREEDY)[0].token_ids


def test_from_pretrained_with_bfloat16_runs_in_bfloat16(tiny_llama):
    built = LLMEngine.from_pretrained(
        str(tiny_llama), dtype=torch.bfloat16, max_model_len=MAX_MODEL_LEN, num_blocks=64
    )
    assert built.dtype == torch.bfloat16 and built.config.dtype == "bfloat16" and built.dtype_bytes == 2
    assert len(built.generate(["Hello"], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_max_model_len_is_capped_at_the_model_positions(tiny_llama):
    capped = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=100_000, num_blocks=8)
    assert capped.max_model_len == capped.model_config.max_position_embeddings


def test_a_request_as_large_as_the_whole_pool_is_served_by_an_idle_engine(tiny_llama):
    # 200 usable blocks of 4 tokens, 2 of them the admission watermark; the prompt alone needs all 200
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=1024, block_size=4, num_blocks=201)
    assert engine.kv.watermark_blocks > 0
    engine.add_request("whole-pool", [5] * 797, SamplingParams(max_tokens=3, ignore_eos=True))
    finished = []
    for _ in range(10):
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["whole-pool"]
    assert len(finished[0].token_ids) == 3


def test_a_duplicate_id_of_a_live_request_is_refused(engine):
    engine.add_request("live", "Hello", GREEDY)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("live", "Other", GREEDY)
    assert info.value.field == "request_id"
    assert engine.unfinished_request_ids() == ["live"] and engine.get_stats().num_waiting == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].prompt == "Hello" and len(outputs[-1].token_ids) == GREEDY.max_tokens
    assert_idle(engine)


def test_the_id_of_a_finished_request_can_be_used_again(engine):
    engine.add_request("again", "Hello", GREEDY)
    run_to_completion(engine)
    engine.add_request("again", "Hello", GREEDY)
    assert run_to_completion(engine) == ["again"]


def test_generate_with_one_bad_prompt_queues_none_of_them(engine):
    with pytest.raises(InvalidRequestError):
        engine.generate(["Hello", ""], GREEDY)
    assert_idle(engine)


def test_generate_with_a_params_list_of_another_length_is_refused(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(["Hello", "World"], [GREEDY])
    assert info.value.field == "params"
    assert_idle(engine)


# -- abort and mixed prompts ----------------------------------------------------------------------


def test_aborting_an_unknown_id_is_a_no_op(engine):
    before = engine.get_stats()
    engine.abort_request("no-such-request")
    engine.abort_request(["neither", "nor-this"])
    assert engine.step() == []
    assert engine.get_stats().requests_finished_total == before.requests_finished_total
    assert_idle(engine)


def test_aborting_a_queued_request_returns_its_final_output(engine):
    engine.add_request("to-abort", "Hello", GREEDY)
    engine.abort_request("to-abort")
    (final,) = engine.step()
    assert final.request_id == "to-abort" and final.finished
    assert final.finish_reason == "abort" and final.token_ids == []
    assert_idle(engine)


def test_aborting_an_n_request_before_its_first_token_ends_every_output(engine):
    engine.add_request("n-abort", "Hello", SamplingParams(n=3, max_tokens=8))
    engine.abort_request("n-abort")
    (final,) = engine.step()
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" and c.token_ids == [] for c in final.outputs)
    assert_idle(engine)


def test_aborting_an_n_request_mid_generation_ends_every_output(engine):
    engine.add_request("n-abort-late", "Hello", SamplingParams(n=3, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("n-abort-late")
    (final,) = engine.step()
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 4 for c in final.outputs)
    assert_idle(engine)


def test_generate_of_mixed_prompt_kinds_returns_outputs_in_order(engine):
    messages = [{"role": "user", "content": "Hi"}]
    outs = engine.generate(["Hello", [1, 2, 3], messages], GREEDY)
    assert outs[0].prompt == "Hello"
    assert outs[1].prompt_token_ids == [1, 2, 3] and outs[1].prompt is None
    assert outs[2].prompt_token_ids == engine.tokenizer.encode_chat(messages)
    for out, prompt in zip(outs, ["Hello", [1, 2, 3], messages], strict=True):
        assert out.token_ids == engine.generate([prompt], GREEDY)[0].token_ids


def test_generate_of_a_token_list_is_one_prompt(engine):
    outs = engine.generate([1, 2, 3], GREEDY)
    assert len(outs) == 1 and outs[0].prompt_token_ids == [1, 2, 3]


# -- metrics --------------------------------------------------------------------------------------


def test_request_metrics_are_filled_and_consistent(engine):
    prompt = _tokens(engine, 20, offset=1)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time
    assert m.ttft > 0 and m.queue_time >= 0 and m.e2e_latency >= m.ttft
    assert len(m.inter_token_latencies) == len(out.token_ids) - 1
    assert all(latency >= 0 for latency in m.inter_token_latencies)
    assert m.decode_time == pytest.approx(sum(m.inter_token_latencies))
    assert m.num_prompt_tokens == 20
    assert m.num_generation_tokens == 12
    assert m.num_preemptions == 0


def test_metrics_count_prefix_cached_tokens(engine):
    prompt = _tokens(engine, 40, offset=2)
    engine.generate([prompt], GREEDY)
    again = engine.generate([[*prompt[:32], 7, 8]], GREEDY)[0]
    assert again.metrics.num_cached_tokens == 32


def test_stats_count_prompt_and_generated_tokens_and_finished_requests(engine):
    before = engine.get_stats()
    prompts = [_tokens(engine, n, offset=10 + n) for n in (5, 9, 17)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("stats-abort", _tokens(engine, 4, offset=3), GREEDY)
    engine.step()
    engine.abort_request("stats-abort")
    engine.step()
    after = engine.get_stats()
    assert after.prompt_tokens_total - before.prompt_tokens_total == 5 + 9 + 17 + 4
    assert after.generation_tokens_total - before.generation_tokens_total == 3 * 6 + 1
    finished = {
        reason: count - before.requests_finished_total.get(reason, 0)
        for reason, count in after.requests_finished_total.items()
    }
    assert finished.get("length") == len(outs) and finished.get("abort") == 1
    assert finished.get("stop", 0) == 0
    assert after.num_steps_total > before.num_steps_total


def test_stats_count_requests_finished_by_a_stop(engine):
    before = engine.get_stats().requests_finished_total.get("stop", 0)
    first = engine.generate(["Hello"], GREEDY)[0].token_ids[0]
    engine.generate(["Hello"], SamplingParams(temperature=0.0, stop_token_ids=[first]))
    assert engine.get_stats().requests_finished_total["stop"] == before + 1


def test_stats_show_running_and_waiting_requests_during_a_run(tiny_llama):
    engine = LLMEngine.from_pretrained(
        str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_blocks=64, max_num_seqs=2
    )
    for i in range(3):
        engine.add_request(
            f"r{i}", _tokens(engine, 6, offset=i), SamplingParams(max_tokens=4, ignore_eos=True)
        )
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 3)
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_used_blocks == 2 and stats.kv_usage == pytest.approx(2 / stats.kv_num_blocks)
    run_to_completion(engine)
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.requests_finished_total == {"length": 3}


# -- priorities -----------------------------------------------------------------------------------


def _single_lane(tiny_llama, aging_seconds: float) -> tuple[LLMEngine, list[float]]:
    """An engine running one sequence at a time, its scheduler on a clock the test moves."""
    engine = LLMEngine.from_pretrained(
        str(tiny_llama),
        max_model_len=MAX_MODEL_LEN,
        num_blocks=64,
        max_num_seqs=1,
        aging_seconds=aging_seconds,
    )
    t = [0.0]
    engine.scheduler.clock = lambda: t[0]
    return engine, t


def test_a_later_high_priority_request_is_served_first(tiny_llama):
    engine, _ = _single_lane(tiny_llama, aging_seconds=0.0)
    engine.add_request("low", "Hello", GREEDY, priority=0, arrival_time=0.0)
    engine.add_request("high", "World", GREEDY, priority=5, arrival_time=1.0)
    assert run_to_completion(engine) == ["high", "low"]


def test_a_high_priority_request_preempts_a_running_low_priority_one(tiny_llama):
    engine, _ = _single_lane(tiny_llama, aging_seconds=0.0)
    alone = engine.generate(["Hello"], GREEDY)[0].token_ids
    engine.add_request("low", "Hello", GREEDY, priority=0, arrival_time=0.0)
    engine.step()
    engine.step()
    engine.add_request("high", "World", GREEDY, priority=5, arrival_time=1.0)
    finished, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                outputs[out.request_id] = out
    assert finished == ["high", "low"]
    assert outputs["low"].metrics.num_preemptions == 1
    assert outputs["low"].token_ids == alone


def _starvation(tiny_llama, aging_seconds: float, steps: int) -> bool:
    """A low-priority request against a stream of high-priority ones: is it served within `steps`?"""
    engine, t = _single_lane(tiny_llama, aging_seconds)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", "Hello", short, priority=0, arrival_time=0.0)
    for i in range(steps):
        t[0] = float(i)
        if engine.get_stats().num_waiting < 3:  # keep high-priority requests coming
            engine.add_request(f"high-{i}", "World", short, priority=5, arrival_time=t[0])
        if any(o.request_id == "low" and o.finished for o in engine.step()):
            return True
    return False


def test_aging_admits_a_waiting_low_priority_request_eventually(tiny_llama):
    assert _starvation(tiny_llama, aging_seconds=1.0, steps=40)


def test_without_aging_a_stream_of_high_priority_requests_starves_a_low_one(tiny_llama):
    assert not _starvation(tiny_llama, aging_seconds=0.0, steps=40)
