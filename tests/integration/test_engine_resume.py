"""A resumed request (a job's new run after its engine died) on a tiny real model: given the output
tokens an earlier run already sent, the engine goes on exactly as an uninterrupted run would,
greedy and seeded, with penalties, stop strings, a structured format, max_tokens and logprobs
counted over the whole output, and sends only what follows; impossible prefixes are refused by
field."""

from __future__ import annotations

import dataclasses

import pytest

from libs.engine import InvalidRequestError, LLMEngine, OutputKind, SamplingParams
from libs.structured_output import StructuredOutput

PROMPT = "def add(a, b):"
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.2
    ),
}
EMAIL = StructuredOutput("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=128)


def _run(engine: LLMEngine, params: SamplingParams, resume: list[int] = (), request_id: str = "r"):
    """One request streamed to its end: its last output, its deltas' (token ids, text), and the
    logprobs it sent."""
    params = dataclasses.replace(params, output_kind=OutputKind.DELTA)
    engine.add_request(request_id, PROMPT, params, resume=resume)
    deltas, logprobs, final = [], [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append((list(output.outputs[0].token_ids), output.outputs[0].text))
            logprobs += output.outputs[0].logprobs or []
            final = output
    return final, deltas, logprobs


def _tokens(deltas) -> list[int]:
    return [token for ids, _ in deltas for token in ids]


def _text(deltas) -> str:
    return "".join(text for _, text in deltas)


def _sent_by(deltas, cut: int) -> tuple[list[int], str]:
    """What a caller had been sent once `cut` tokens had come (the stream is one token a step)."""
    taken = []
    for ids, text in deltas:
        if len(_tokens(taken)) + len(ids) > cut:
            break
        taken.append((ids, text))
    assert len(_tokens(taken)) == cut
    return _tokens(taken), _text(taken)


def _check_resumes(engine, params: SamplingParams, cuts, tag: str):
    """Resume the request after each cut of its uninterrupted run: the same tokens follow, and the
    text sent before the cut plus the resumed run's is the uninterrupted text."""
    whole, deltas, logprobs = _run(engine, params, request_id=f"{tag}-whole")
    for cut in cuts or range(1, len(_tokens(deltas))):  # default: every cut before its last token
        prefix, sent = _sent_by(deltas, cut)
        rest, rest_deltas, rest_logprobs = _run(engine, params, resume=prefix, request_id=f"{tag}-{cut}")
        assert _tokens(rest_deltas) == _tokens(deltas)[cut:], (tag, cut)
        assert sent + _text(rest_deltas) == _text(deltas), (tag, cut)
        assert rest.outputs[0].finish_reason == whole.outputs[0].finish_reason
        if params.logprobs is not None:  # the resumed tokens' are not sent again
            assert len(logprobs) == len(_tokens(deltas)) and rest_logprobs == logprobs[cut:]
    return _tokens(deltas), whole


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(engine, case):
    tokens, _ = _check_resumes(engine, CASES[case], (1, 13), case)
    assert len(tokens) == 24  # max_tokens counted the resumed tokens too


def test_a_resumed_stop_string_and_format_count_the_whole_output(engine):
    # a format: the resumed run's grammar starts after the prefix
    params = SamplingParams(temperature=0.0, max_tokens=24, structured=EMAIL)
    _, whole = _check_resumes(engine, params, (1, 3, 5), "format")
    assert whole.outputs[0].finish_reason == "stop"
    # a stop string that spans a cut: the resumed run holds back what the first one held back
    greedy = dataclasses.replace(CASES["greedy"], logprobs=None)
    _, deltas, _ = _run(engine, greedy, request_id="plain")
    text = _text(deltas)
    stop = text[len(_sent_by(deltas, 6)[1]) - 1 :][:3]
    tokens, stopped = _check_resumes(engine, dataclasses.replace(greedy, stop=[stop]), None, "stop")
    assert stopped.outputs[0].finish_reason == "stop" and 6 <= len(tokens) < 24


def test_impossible_prefixes_are_refused_by_field(engine):
    greedy = CASES["greedy"]
    eos = next(iter(engine.tokenizer.eos_token_ids))
    refusals = [
        (greedy, [engine.model_config.vocab_size], "resume_token_ids[0]"),
        (dataclasses.replace(greedy, ignore_eos=False), [5, eos], "resume_token_ids[1]"),
        (dataclasses.replace(greedy, max_tokens=2), [5, 6], "resume_token_ids"),
        (dataclasses.replace(greedy, n=2), [5], "resume_token_ids"),
        (
            SamplingParams(temperature=0.0, max_tokens=8, structured=EMAIL),
            [engine.tokenizer.encode("@")[0]],
            "resume_token_ids[0]",
        ),
    ]
    for params, resume, field in refusals:
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_request("bad", PROMPT, params, resume=resume)
        assert refused.value.field == field
    assert not engine.has_unfinished_requests()
