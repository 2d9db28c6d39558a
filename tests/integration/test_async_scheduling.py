"""Asynchronous scheduling (`async_scheduling="on"`) on the CPU, through the same code a GPU runs:
a step is launched before the previous step's tokens are read back, its inputs taking them from
the previous step's device output, and every request ends with exactly the tokens, text and finish
reasons of the steps run in series (`"off"`)."""

from __future__ import annotations

import json

import pytest
import torch

import libs.engine.runner as runner_module
from libs.engine import LLMEngine, SamplingParams
from libs.engine.sessions import SessionRef
from libs.engine.tokenizer.turns import encode_turn
from libs.structured_output import StructuredOutput

SETTINGS = {"max_model_len": 512, "num_blocks": 160, "block_size": 16, "max_num_batched_tokens": 64}


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 300, (int(torch.randint(2, 90, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def engines(tiny_llama) -> dict[str, LLMEngine]:
    return {
        mode: LLMEngine.from_pretrained(str(tiny_llama), async_scheduling=mode, **SETTINGS)
        for mode in ("off", "on")
    }


def _finals(engine: LLMEngine, prompts, params, **kwargs):
    return [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(prompts, params, **kwargs)]


def _same_in_both(engines, prompts, params, **kwargs):
    series = _finals(engines["off"], prompts, params, **kwargs)
    assert _finals(engines["on"], prompts, params, **kwargs) == series
    return series


def test_the_setting_picks_the_cpu_default_and_the_forced_mode(engines, tiny_llama):
    assert engines["on"].async_scheduling and not engines["off"].async_scheduling
    assert not LLMEngine.from_pretrained(str(tiny_llama), **SETTINGS).async_scheduling  # auto, CPU


def test_greedy_outputs_are_those_of_steps_in_series(engines, monkeypatch):
    # Prompts longer than the 64-token step budget take several prefill chunks, none sampling.
    runner = engines["on"].runner
    launches = []

    def launch(step, previous=None):  # the real launch, recording whether it ran ahead
        launches.append(previous is not None)
        return type(runner).launch(runner, step, previous)

    monkeypatch.setattr(runner, "launch", launch)
    _same_in_both(
        engines, _prompts(6, seed=1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )
    assert sum(launches) >= 19  # every decode step after the first took its inputs from the device


def test_seeded_outputs_are_those_of_steps_in_series(engines):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=16, ignore_eos=True)
    _same_in_both(engines, _prompts(5, seed=2), params)


def test_max_tokens_and_stop_tokens_end_outputs_where_they_end_in_series(engines):
    prompts = _prompts(6, seed=3)
    by_length = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5, 8, 13)]
    finals = _same_in_both(engines, prompts, by_length)
    assert [len(ids) for ids, _, _ in finals] == [1, 2, 3, 5, 8, 13]
    # a stop token met mid-output: the first token greedy decoding gives each prompt at step 4
    fourth = [
        ids[3]
        for ids, _, _ in _finals(engines["off"], prompts, SamplingParams(temperature=0.0, max_tokens=6))
    ]
    stops = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[t]) for t in fourth]
    finals = _same_in_both(engines, prompts, stops)
    assert all(reason == "stop" and len(ids) <= 4 for ids, _, reason in finals)


def test_stop_strings_end_outputs_where_they_end_in_series(engines):
    prompts = _prompts(4, seed=4)
    texts = [
        text
        for _, text, _ in _finals(engines["off"], prompts, SamplingParams(temperature=0.0, max_tokens=12))
    ]
    stops = [SamplingParams(temperature=0.0, max_tokens=30, stop=[t[3:6]]) for t in texts if len(t) > 6]
    assert stops
    _same_in_both(engines, prompts[: len(stops)], stops)


def test_a_sequence_that_ends_leaves_its_blocks_and_cache_as_in_series(tiny_llama):
    # Fresh engines: the blocks, counters and prefix cache start alike.
    engines = {
        mode: LLMEngine.from_pretrained(str(tiny_llama), async_scheduling=mode, **SETTINGS)
        for mode in ("off", "on")
    }
    prompts = _prompts(3, seed=5)
    _same_in_both(engines, prompts, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    stats = {mode: e.get_stats() for mode, e in engines.items()}
    assert stats["on"].generation_tokens_total == stats["off"].generation_tokens_total == 21
    assert stats["on"].kv_free_blocks == stats["off"].kv_free_blocks
    # the prefix cache the ended outputs left gives the same prompts again the same hits
    _same_in_both(engines, prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    hits = {mode: e.get_stats().prefix_cache_hit_rate for mode, e in engines.items()}
    assert hits["on"] == hits["off"] > 0


def test_requests_that_need_their_tokens_on_the_host_run_in_series_beside_the_others(engines):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=24, structured=StructuredOutput("json_schema", json.dumps(schema))
        ),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=8, n=2, seed=3, ignore_eos=True),
    ]
    _same_in_both(engines, _prompts(4, seed=6), params)


def test_session_turns_keep_the_kv_of_steps_in_series(engines):
    def conversation(engine: LLMEngine) -> list[list[int]]:
        history: list[int] = []
        outputs = []
        for i, text in enumerate(("hello there", "and then?", "one more")):
            prompt = history + encode_turn(engine.tokenizer, history, [{"role": "user", "content": text}])
            ref = SessionRef("s", history_tokens=len(history))
            engine.add_request(
                f"turn-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5), session=ref
            )
            final = None
            while engine.has_unfinished_requests():
                final = next((o for o in engine.step() if o.finished), final)
            outputs.append(list(final.outputs[0].token_ids))
            history = prompt + outputs[-1]
        engine.end_session("s")
        return outputs

    assert conversation(engines["on"]) == conversation(engines["off"])


def test_experts_apply_to_steps_that_run_ahead(tiny_llama, expert_packages):
    packages, publisher = expert_packages
    engines = {
        mode: LLMEngine.from_pretrained(str(tiny_llama), async_scheduling=mode, **SETTINGS)
        for mode in ("off", "on")
    }
    for engine in engines.values():
        for package in packages.values():
            engine.load_expert(package, publisher.trusted)
    experts = [[("lora", 1.0)], None, [("lora-qv", 0.5), ("ia3", 1.0)]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    _same_in_both(engines, _prompts(3, seed=7), params, experts=experts)


def test_an_aborted_request_drops_its_token_in_flight(engines):
    engine = engines["on"]
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(_prompts(2, seed=8)):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(6):
        engine.step()
    engine.abort_request("abort-0")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["abort-0"].outputs[0].finish_reason == "abort"
    assert len(finals["abort-1"].outputs[0].token_ids) == 50
    assert engine.kv.pool.num_allocatable_blocks == engine.kv.pool.num_usable_blocks  # nothing held


def test_an_aborted_session_turn_keeps_no_token_in_flight(engines):
    engine = engines["on"]
    prompt = encode_turn(engine.tokenizer, [], [{"role": "user", "content": "a long answer please"}])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("cut", prompt, params, session=SessionRef("cut-short", history_tokens=0))
    streamed: list[int] = []
    for _ in range(8):
        for out in engine.step():
            streamed = list(out.outputs[0].token_ids)
    engine.abort_request("cut")
    engine.step()
    parked = engine.sessions._sessions["cut-short"].parked  # the turn's sequence, kept for the next
    assert parked is not None and parked.num_placeholders == 0
    assert parked.token_ids[len(prompt) :] == streamed and parked.num_computed_tokens == parked.num_tokens - 1
    engine.end_session("cut-short")


def test_decode_graph_replays_take_the_carried_tokens(tiny_llama, engines):
    # A replayed step reads its captured region: the carried tokens must reach it.
    graphed = LLMEngine.from_pretrained(
        str(tiny_llama), async_scheduling="on", cuda_graphs="on", max_num_seqs=8, **SETTINGS
    )
    prompts, params = _prompts(5, seed=9), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert _finals(graphed, prompts, params) == _finals(engines["off"], prompts, params)
    assert any(step.replays for step in graphed.runner.graphs.steps.values())


def test_structured_output_masks_are_computed_after_the_forward_pass_is_queued(engines, monkeypatch):
    # The masks are host work (the grammar's matcher); staged after the forward pass is queued,
    # they overlap the device's work on a GPU. Here the order of the calls shows it.
    engine = engines["off"]
    calls: list[str] = []
    forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        calls.append("forward")
        return forward(*args, **kwargs)

    fill = runner_module.fill_mask_fields

    def recording_fill(views, sample):
        calls.append("masks")
        return fill(views, sample)

    monkeypatch.setattr(engine.model, "forward", recording_forward)
    monkeypatch.setattr(runner_module, "fill_mask_fields", recording_fill)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        temperature=0.0, max_tokens=16, structured=StructuredOutput("json_schema", json.dumps(schema))
    )
    engine.generate(_prompts(1, seed=10), params)
    assert calls.count("masks") >= 2  # one per sampled step
    assert all(calls[i - 1] == "forward" for i, call in enumerate(calls) if call == "masks")
