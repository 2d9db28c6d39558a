"""Sampling parameters end to end on a tiny real model (and the default model where it says so):
stop ids and strings, lengths, EOS, logprobs against transformers, seeds, n, output kinds, chat."""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import json
import shutil

import pytest
import torch

from libs.engine import LLMEngine, OutputKind, RequestOutput, SamplingParams
from libs.engine.sampler import SamplingBatch, _apply_penalties
from libs.engine.staging import Layout
from libs.engine.step_inputs import SampleRows, add_sampling_fields, fill_sampling_fields, sampling_batch
from tests.helpers.reference import hf_greedy, load_hf

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# Prompts whose greedy continuations on the tiny model hold stretches of printable ASCII.
PROMPTS = ["def add(a, b):", "SELECT name", "Hello", "Expert systems route"]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=128)


@pytest.fixture(scope="module")
def default_engine(default_model) -> LLMEngine:
    return LLMEngine.from_pretrained(str(default_model), max_model_len=512, num_blocks=64)


def complete_text(tokenizer, ids: list[int]) -> str:
    """The text of byte-level `ids` less a character cut off at the end (Python's incremental UTF-8
    decoder holds such trailing bytes back)."""
    data = b"".join(tokenizer.token_bytes(i) for i in ids)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def one(engine: LLMEngine, prompt, params: SamplingParams) -> RequestOutput:
    return engine.generate([prompt], params)[0]


def stream(engine: LLMEngine, prompt, params: SamplingParams, request_id: str) -> list[RequestOutput]:
    """Every output the engine hands back for one request, step by step."""
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def stop_string_spanning_tokens(engine: LLMEngine, prompt: str) -> tuple[str, int] | None:
    """A 3-character printable substring of the greedy output that starts in one token and ends in
    the next, near the middle and at its first occurrence; with its position in the text."""
    out = one(engine, prompt, GREEDY)
    text, ids = out.text, out.token_ids
    middle = len(ids) // 2
    for i in sorted(range(len(ids) // 4, 3 * len(ids) // 4), key=lambda i: abs(i - middle)):
        before = engine.tokenizer.decode(ids[:i])
        cut = len(before)
        candidate = text[cut - 2 : cut + 1]
        if (
            text.startswith(before)
            and cut >= 2
            and len(candidate) == 3
            and candidate.isascii()
            and candidate.isprintable()
            and text.find(candidate) == cut - 2
        ):
            return candidate, cut - 2
    return None


@pytest.fixture(scope="module")
def stop_case(engine) -> tuple[str, str, str]:
    """(prompt, greedy text, stop string) for the stop-string tests."""
    for prompt in PROMPTS:
        found = stop_string_spanning_tokens(engine, prompt)
        if found is not None:
            return prompt, one(engine, prompt, GREEDY).text, found[0]
    raise AssertionError("no prompt gives a greedy text with a stop string spanning two tokens")


# -- stopping -------------------------------------------------------------------------------------


def test_a_stop_token_id_ends_the_sequence_on_that_token(engine):
    full = one(engine, PROMPTS[0], GREEDY).token_ids
    position = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    stop_id = full[position]
    out = one(engine, PROMPTS[0], dataclasses.replace(GREEDY, stop_token_ids=[stop_id]))
    completion = out.outputs[0]
    assert completion.token_ids == full[: position + 1]
    assert completion.token_ids[-1] == stop_id
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id


def test_a_stop_token_text_is_left_out_of_the_output(engine):
    full = one(engine, PROMPTS[0], GREEDY).token_ids
    position = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    stopped = one(engine, PROMPTS[0], dataclasses.replace(GREEDY, stop_token_ids=[full[position]]))
    cut = one(engine, PROMPTS[0], dataclasses.replace(GREEDY, max_tokens=position))
    assert stopped.text == cut.text


def test_a_stop_string_never_appears_and_the_text_is_cut_before_it(engine, stop_case):
    prompt, full_text, stop = stop_case
    out = one(engine, prompt, dataclasses.replace(GREEDY, stop=[stop]))
    completion = out.outputs[0]
    assert stop not in completion.text
    assert completion.text == full_text[: full_text.index(stop)]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop


def test_a_stop_string_ends_generation_at_the_token_that_completes_it(engine, stop_case):
    prompt, _, stop = stop_case
    full = one(engine, prompt, GREEDY).token_ids
    out = one(engine, prompt, dataclasses.replace(GREEDY, stop=[stop]))
    assert out.token_ids == full[: len(out.token_ids)]
    assert stop in engine.tokenizer.decode(out.token_ids)
    assert stop not in engine.tokenizer.decode(out.token_ids[:-1])


def test_include_stop_str_in_output_keeps_the_stop_string(engine, stop_case):
    prompt, full_text, stop = stop_case
    params = dataclasses.replace(GREEDY, stop=[stop], include_stop_str_in_output=True)
    out = one(engine, prompt, params)
    assert out.text == full_text[: full_text.index(stop) + len(stop)]
    assert out.outputs[0].stop_reason == stop


def test_the_stop_string_that_completes_first_wins(engine, stop_case):
    prompt, full_text, stop = stop_case
    later = full_text[full_text.index(stop) + len(stop) :][:3]
    assert later and later not in full_text[: full_text.index(stop) + len(stop)]
    out = one(engine, prompt, dataclasses.replace(GREEDY, stop=[later, stop]))
    assert out.outputs[0].stop_reason == stop


def test_a_streamed_stop_string_never_reaches_a_delta(engine, stop_case):
    prompt, full_text, stop = stop_case
    params = dataclasses.replace(GREEDY, stop=[stop], output_kind=OutputKind.DELTA)
    deltas = stream(engine, prompt, params, "stop-delta")
    assert "".join(d.text for d in deltas) == full_text[: full_text.index(stop)]
    assert all(stop not in d.text for d in deltas)


def test_text_held_back_for_a_possible_stop_string_is_released_at_the_end(engine):
    full = one(engine, "Hello", dataclasses.replace(GREEDY, max_tokens=12)).text
    unlikely = full[-2:] + "\u2603"  # the text ends with the start of this stop string
    out = one(engine, "Hello", dataclasses.replace(GREEDY, max_tokens=12, stop=[unlikely]))
    assert out.text == full and out.finish_reason == "length"


def test_the_text_is_the_decoded_token_ids(engine):
    for prompt in PROMPTS:
        for params in (GREEDY, SamplingParams(temperature=1.0, seed=9, max_tokens=32, ignore_eos=True)):
            out = one(engine, prompt, params)
            assert out.text == complete_text(engine.tokenizer, out.token_ids)
            assert engine.tokenizer.decode(out.token_ids).startswith(out.text)


def cuts_inside_characters(engine: LLMEngine, prompt: str) -> tuple[list[int], list[int]]:
    """The greedy output of `prompt` and the lengths at which it ends inside a character."""
    ids = one(engine, prompt, dataclasses.replace(GREEDY, max_tokens=48)).token_ids
    tokenizer = engine.tokenizer
    return ids, [
        k for k in range(1, len(ids)) if complete_text(tokenizer, ids[:k]) != tokenizer.decode(ids[:k])
    ]


def test_an_output_cut_by_max_tokens_inside_a_character_leaves_it_out_of_the_text(engine):
    # The tiny model's greedy output is full of tokens that end inside a character: cut it there.
    reached = 0
    for prompt in PROMPTS:
        ids, cuts = cuts_inside_characters(engine, prompt)
        for k in cuts:
            params = dataclasses.replace(GREEDY, max_tokens=k, output_kind=OutputKind.DELTA)
            deltas = stream(engine, prompt, params, f"cut-{prompt}-{k}")
            assert [t for d in deltas for t in d.outputs[0].token_ids] == ids[:k]  # every token id
            assert deltas[-1].finish_reason == "length"
            text = "".join(d.outputs[0].text for d in deltas)
            assert engine.tokenizer.decode(ids[:k]).endswith("\ufffd")
            assert text == complete_text(engine.tokenizer, ids[:k])
            reached += 1
    assert reached >= 10


@pytest.mark.parametrize("ending", ["stop_token", "abort"])
def test_an_output_stopped_or_aborted_inside_a_character_leaves_it_out_of_the_text(engine, ending):
    ids, cuts = cuts_inside_characters(engine, "Hello")
    k = next(k for k in cuts if ids[k] not in ids[:k])
    params = dataclasses.replace(GREEDY, output_kind=OutputKind.DELTA)
    if ending == "stop_token":
        params.stop_token_ids = [ids[k]]
    engine.add_request(f"cut-{ending}", "Hello", params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
        if ending == "abort" and sum(len(d.outputs[0].token_ids) for d in deltas) == k:
            engine.abort_request(f"cut-{ending}")
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    assert tokens == (ids[: k + 1] if ending == "stop_token" else ids[:k])
    assert deltas[-1].finish_reason == ("stop" if ending == "stop_token" else "abort")
    assert "".join(d.outputs[0].text for d in deltas) == complete_text(engine.tokenizer, ids[:k])


def test_without_max_tokens_a_sequence_runs_to_max_model_len(engine):
    out = one(engine, [5] * 200, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out.token_ids) == engine.max_model_len - 200
    assert out.finish_reason == "length"


def test_a_stop_string_at_the_very_start_gives_an_empty_text(engine):
    full = one(engine, "Hello", GREEDY).text
    out = one(engine, "Hello", dataclasses.replace(GREEDY, stop=[full[:2]]))
    assert out.text == "" and out.outputs[0].stop_reason == full[:2] and out.finish_reason == "stop"


def test_a_stop_string_only_in_the_prompt_does_not_stop(engine):
    full = one(engine, "Hello", GREEDY).text
    assert "ell" not in full
    out = one(engine, "Hello", dataclasses.replace(GREEDY, stop=["ell"]))
    assert out.text == full and out.finish_reason == "length"


@pytest.mark.default_model
def test_special_tokens_appear_in_the_text_unless_skipped(default_engine):
    # Past its answer, SmolLM2 emits <|im_end|> (ignored here) and goes on with chat markup.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = default_engine.chat(messages, params)[0]
    specials = set(default_engine.tokenizer.all_special_ids)
    assert specials & set(out.token_ids)
    kept = default_engine.chat(messages, dataclasses.replace(params, skip_special_tokens=False))[0]
    assert kept.token_ids == out.token_ids
    assert kept.text == default_engine.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert out.text == default_engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "<|im_end|>" in kept.text and "<|im_end|>" not in out.text


@pytest.mark.parametrize("max_tokens", [1, 5, 17])
def test_max_tokens_gives_exactly_that_many_tokens_and_length(engine, max_tokens):
    out = one(engine, "Hello", dataclasses.replace(GREEDY, max_tokens=max_tokens))
    assert len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"
    assert out.outputs[0].stop_reason is None


def test_eos_ends_the_sequence_unless_ignored(tiny_llama, engine, tmp_path):
    # A copy of the tiny checkpoint whose generation config names, as its end-of-sequence token,
    # the 6th token the model produces greedily: EOS must stop there, and only there.
    produced = one(engine, "Hello", GREEDY).token_ids
    eos = produced[5]
    copy = tmp_path / "eos"
    shutil.copytree(tiny_llama, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with_eos = LLMEngine.from_pretrained(str(copy), max_model_len=256, num_blocks=128)
    assert eos in with_eos.tokenizer.eos_token_ids
    out = one(with_eos, "Hello", dataclasses.replace(GREEDY, ignore_eos=False))
    assert out.token_ids == produced[: produced.index(eos) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None
    ignored = one(with_eos, "Hello", GREEDY)
    assert ignored.token_ids == produced and ignored.finish_reason == "length"


@pytest.mark.default_model
def test_the_default_model_answers_a_chat_question_and_stops_at_eos(default_engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    assert out.token_ids[-1] in default_engine.tokenizer.eos_token_ids
    assert len(out.token_ids) < 64


@pytest.mark.default_model
def test_the_default_model_ignoring_eos_runs_to_max_tokens(default_engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    out = default_engine.chat(messages, params)[0]
    assert len(out.token_ids) == 20
    assert out.finish_reason == "length"


# -- penalties ------------------------------------------------------------------------------------


def _staged_sampling_batch(engine, seq) -> SamplingBatch:
    """The sampler's batch for one row of `seq`, staged as the runner stages a step's."""
    sample, vocab = SampleRows([0], [seq], [0]), engine.model_config.vocab_size
    layout = Layout()
    add_sampling_fields(layout, sample, vocab)
    fill_sampling_fields(engine.runner.staging.stage(layout), sample, vocab)
    return sampling_batch(engine.runner.staging.send(layout), sample)


def test_penalties_leave_eos_stop_ids_and_chat_control_tokens_alone(engine):
    # Through the engine's own path: the request's exempt ids, the runner's sampling batch, the
    # sampler's penalties; a chat prompt and an output holding the control tokens many times.
    tokenizer = engine.tokenizer
    im_start, im_end = (tokenizer.backend.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    endoftext = tokenizer.backend.token_to_id("<|endoftext|>")
    word, stop = tokenizer.encode("Hello")[0], tokenizer.encode(" world")[-1]
    assert tokenizer.eos_token_ids == {im_end} and len({im_start, im_end, endoftext, word, stop}) == 5
    params = SamplingParams(
        repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=1.0, stop_token_ids=[stop]
    )
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello"}] * 3
    request = engine.prepare_request("exempt", conversation, params)
    seq = request.seqs[0]
    for token in [im_start, word, im_end, endoftext, stop] * 4:
        seq.append_token(token)
    assert {im_start, im_end, word} <= set(seq.prompt_token_ids)
    logits = torch.linspace(-2.0, 2.0, engine.model_config.vocab_size)[None, :]
    logits[0, [im_start, im_end, endoftext, stop, word]] = torch.tensor([1.0, 2.0, -1.0, 0.5, 1.5])
    out = _apply_penalties(logits.clone(), _staged_sampling_batch(engine, seq))
    for token in (im_start, im_end, endoftext, stop):
        assert out[0, token] == logits[0, token]
    assert out[0, word] == pytest.approx(1.5 / 1.3 - 4 - 1)  # 4 times in the output


@pytest.mark.default_model
def test_the_default_model_with_a_repetition_penalty_still_ends_its_turn(default_engine):
    # Seed 47 ran to its 2048-token cap before the end-of-turn token was exempted from penalties.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1, max_tokens=400, seed=47)
    out = default_engine.chat(messages, params)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in default_engine.tokenizer.eos_token_ids


# -- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_logprobs", [0, 1, 5])
def test_logprobs_give_n_entries_per_position_with_the_sampled_token(engine, n_logprobs):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=n_logprobs)
    completion = one(engine, "Hello", params).outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(entries) in (n_logprobs, n_logprobs + 1)
        assert token in entries
        ranked = sorted((e for e in entries.values() if e.rank >= 1), key=lambda e: e.rank)
        assert [e.rank for e in ranked][:n_logprobs] == list(range(1, n_logprobs + 1))
        values = [e.logprob for e in ranked]
        assert values == sorted(values, reverse=True)
    assert completion.cumulative_logprob == pytest.approx(
        sum(entries[t].logprob for t, entries in zip(completion.token_ids, completion.logprobs, strict=True))
    )


def test_no_logprobs_unless_asked(engine):
    completion = one(engine, "Hello", SamplingParams(max_tokens=4, seed=1)).outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_the_sampled_token_carries_its_true_rank(engine):
    completion = one(engine, "Hello", dataclasses.replace(GREEDY, max_tokens=4, logprobs=0)).outputs[0]
    ranks = [entries[t].rank for t, entries in zip(completion.token_ids, completion.logprobs, strict=True)]
    assert ranks == [1, 1, 1, 1]  # greedy: the sampled token is the most likely one


def test_logprobs_equal_transformers_log_softmax_for_the_greedy_sequence(engine, tiny_llama):
    prompt = engine.tokenizer.encode("The quick brown fox jumps")
    steps = 16
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=5)
    completion = one(engine, prompt, params).outputs[0]
    tokens, logits = hf_greedy(load_hf(tiny_llama), prompt, steps)
    assert completion.token_ids == tokens
    for entries, step_logits in zip(completion.logprobs, logits, strict=True):
        reference = step_logits.log_softmax(-1)
        by_rank = [e.token_id for e in sorted(entries.values(), key=lambda e: e.rank)]
        assert by_rank == reference.topk(5).indices.tolist()
        for token_id, entry in entries.items():
            assert abs(entry.logprob - reference[token_id].item()) <= 1e-3


# -- seeds, n, output kinds -----------------------------------------------------------------------


def test_the_same_seed_gives_the_same_output(engine):
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)
    first, second = one(engine, "Hello", params), one(engine, "Hello", params)
    assert first.token_ids == second.token_ids and first.text == second.text


def test_different_seeds_give_different_outputs(engine):
    a, b = (
        one(engine, "Hello", SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))
        for s in (1, 2)
    )
    assert a.token_ids != b.token_ids


def test_requests_without_a_seed_differ(engine):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert one(engine, "Hello", params).token_ids != one(engine, "Hello", params).token_ids


def test_unseeded_requests_repeat_across_engines_with_the_same_engine_seed(tiny_llama):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def run() -> list[list[int]]:
        engine = LLMEngine.from_pretrained(str(tiny_llama), seed=1234, num_blocks=32)
        return [out.token_ids for out in engine.generate(["Hello", "World"], params)]

    first, second = run(), run()
    assert first == second
    assert first[0] != first[1]


def test_each_of_n_outputs_has_its_own_logprobs(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=10, ignore_eos=True, logprobs=2)
    out = one(engine, "Hello", params)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:
        assert len(c.logprobs) == 10
        assert all(t in entries for t, entries in zip(c.token_ids, c.logprobs, strict=True))
        assert c.cumulative_logprob == pytest.approx(
            sum(entries[t].logprob for t, entries in zip(c.token_ids, c.logprobs, strict=True))
        )


def test_n_greedy_outputs_are_identical_and_indexed(engine):
    out = one(engine, "Hello", dataclasses.replace(GREEDY, n=3, max_tokens=12))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert len({c.text for c in out.outputs}) == 1
    assert (
        out.outputs[0].token_ids == one(engine, "Hello", dataclasses.replace(GREEDY, max_tokens=12)).token_ids
    )


def test_n_outputs_in_a_tiny_pool_are_preempted_yet_unchanged(tiny_llama, engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60, ignore_eos=True)
    small = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=128, num_blocks=7)  # 96 tokens
    out = one(small, [5] * 10, params)
    assert small.get_stats().num_preemptions_total > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in one(engine, [5] * 10, params).outputs]
    assert small.get_stats().kv_used_blocks == 0


def test_the_n_outputs_of_a_request_count_against_max_num_seqs(tiny_llama):
    small = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=128, num_blocks=64, max_num_seqs=2)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    small.add_request("a", "Hello", params)
    small.add_request("b", "World", params)
    most = 0
    while small.has_unfinished_requests():
        small.step()
        most = max(most, small.get_stats().num_running)
    assert most <= 2


def test_concatenated_deltas_equal_the_cumulative_result(engine):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)
    final = stream(engine, PROMPTS[0], params, "cumulative")[-1].outputs[0]
    deltas = stream(engine, PROMPTS[0], dataclasses.replace(params, output_kind=OutputKind.DELTA), "delta")
    assert len(deltas) > 1
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids
    assert [lp for d in deltas for lp in d.outputs[0].logprobs] == final.logprobs
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


def test_cumulative_outputs_grow_by_prefix(engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = stream(engine, "Hello", params, "growing")
    assert len(outputs) == 10
    for before, after in itertools.pairwise(outputs):
        assert after.token_ids[: len(before.token_ids)] == before.token_ids
        assert after.text.startswith(before.text)
    assert [o.finished for o in outputs] == [False] * 9 + [True]


def test_final_only_yields_exactly_one_output(engine):
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY
    )
    outputs = stream(engine, "Hello", params, "final-only")
    assert len(outputs) == 1
    assert outputs[0].finished and len(outputs[0].token_ids) == 10


# -- chat prompts ---------------------------------------------------------------------------------


def test_a_chat_prompt_equals_its_rendered_template_token_ids(engine):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a fox."},
    ]
    as_chat = one(engine, messages, GREEDY)
    as_ids = one(engine, engine.tokenizer.encode_chat(messages), GREEDY)
    assert as_chat.prompt_token_ids == engine.tokenizer.encode_chat(messages)
    assert as_chat.token_ids == as_ids.token_ids
    assert as_chat.prompt == engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_chat_is_generate_of_one_conversation(engine):
    messages = [{"role": "user", "content": "Hello"}]
    assert engine.chat(messages, GREEDY)[0].token_ids == one(engine, messages, GREEDY).token_ids


def test_logprob_entries_are_plain_floats(engine):
    completion = one(engine, "Hello", dataclasses.replace(GREEDY, max_tokens=2, logprobs=1)).outputs[0]
    entry = completion.logprobs[0][completion.token_ids[0]]
    assert isinstance(entry.logprob, float) and not isinstance(entry.logprob, torch.Tensor)
