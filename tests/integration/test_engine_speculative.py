"""Speculative decoding (n-gram drafter): output identical to decoding without it, sampled output
from the target distribution, every feature that ends or shapes an output kept exact, and every KV
block returned. Real engines on a tiny generated Llama; one test on the default model."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from libs.config import ConfigError
from libs.engine.config import EngineConfig
from libs.engine.errors import InvalidRequestError
from libs.engine.llm_engine import LLMEngine
from libs.engine.sampling_params import SamplingParams
from libs.engine.sequence import Sequence
from libs.engine.sessions import SessionRef
from libs.engine.speculative import Speculator, accepted_prefix, ngram_proposal
from libs.structured_output import StructuredOutput
from tests.helpers.statistics import chi_square_p

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Repeating token patterns: the n-gram drafter finds them, and a random tiny model often loops.
PROMPTS = [[(7 * i + j) % 50 + 20 for j in range(5)] * 4 for i in range(6)] + [[30, 31, 32, 33, 30, 31]]


def _engine(model, speculative: str, **overrides) -> LLMEngine:
    settings = {"device": "cpu", "num_blocks": 96, "block_size": 4, "seed": 0, "speculative": speculative}
    settings["speculative_max_rows"] = 256  # every sequence drafts: these batches test verification
    return LLMEngine.from_pretrained(str(model), **(settings | overrides))


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """(ordinary, speculative) engines on the same tiny checkpoint."""
    return _engine(tiny_llama, "off"), _engine(tiny_llama, "ngram")


def _results(outputs) -> list[tuple]:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, _logprobs(c.logprobs))
        for out in outputs
        for c in out.outputs
    ]


def _logprobs(entries) -> list | None:
    if entries is None:
        return None
    return [sorted((tid, round(lp.logprob, 4), lp.rank) for tid, lp in e.items()) for e in entries]


def _assert_blocks_returned(engine: LLMEngine) -> None:
    usage = engine.kv.usage()
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_used_blocks + usage.num_cached_blocks == usage.num_blocks


def _drafted(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.get_stats().speculative
    return stats.drafted_tokens_total, stats.accepted_tokens_total


# -- the drafter and the rule ------------------------------------------------------------------------


def test_ngram_proposal_takes_the_most_recent_longest_match():
    assert ngram_proposal([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]  # the later "1 2 3"
    assert ngram_proposal([1, 2, 3, 4, 5, 8, 2, 3], 3) == [4, 5, 8]  # "2 3" when no 3-gram recurs
    assert ngram_proposal([1, 2, 3, 4], 4) == []  # nothing recurs
    assert ngram_proposal([5, 5, 5, 5], 4) == [5]  # only what follows the match, never past the end
    assert ngram_proposal([1, 2, 1, 2], 0) == []


def test_a_longer_match_drafts_more():
    tokens = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]
    assert ngram_proposal([*tokens, 7], 8) == [1, 2]  # one token matched: at most 2 drafts
    assert ngram_proposal([*tokens, 7, 1], 8) == [2, 3, 4, 5]  # two: at most 4
    assert ngram_proposal([*tokens, 7, 1, 2], 8) == [3, 4, 5, 6, 8, 9, 10, 11]  # three: at most 8


def test_accepted_prefix_stops_at_the_first_differing_sample():
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 1]) == 2
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted_prefix([4], [3, 4]) == 0


def test_low_acceptance_falls_back_to_ordinary_decoding():
    spec = Speculator("ngram", 4)
    seq = Sequence("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=100), request_seed=0)
    spec.prepare([seq], 64)
    assert spec.propose(seq, room=10, max_model_len=64) == [3, 1, 2]  # what followed "1 2"
    spec.record(seq, 3, 3)
    spec.record(seq, 4, 1)
    assert seq.speculation.k == 4  # the n-gram drafter's K stays: the match length bounds a draft
    for _ in range(3):  # nothing kept: the running average drops below the threshold
        spec.record(seq, 1, 0)
    assert spec.stats.fallbacks == 1
    pause = seq.speculation.pause
    assert pause > 0
    assert [spec.propose(seq, 10, 64) for _ in range(pause)] == [[]] * pause  # ordinary decoding
    spec.prepare([seq], 64)
    assert spec.propose(seq, 10, 64) != []  # then it tries again
    spec.prepare([seq], 64)
    assert spec.propose(seq, room=0, max_model_len=64) == []
    assert spec.propose(seq, room=10, max_model_len=seq.num_tokens + 1) == []  # no room in the context


def test_a_step_carries_drafts_up_to_its_row_budget():
    seqs = [
        Sequence(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], SamplingParams(max_tokens=100), request_seed=i)
        for i in range(6)
    ]
    spec = Speculator("ngram", 4, max_rows=8)
    spec.prepare(seqs[:1], 64)
    assert len(spec.propose(seqs[0], room=64, max_model_len=64)) == 4  # alone: its whole K
    spec.prepare(seqs[:4], 64)  # 4 decodes leave 4 rows: one draft each
    assert [len(spec.propose(s, room=64, max_model_len=64)) for s in seqs[:4]] == [1, 1, 1, 1]
    spec.prepare(seqs[:6], 64)  # 6 decodes leave 2 rows: the first two sequences draft
    assert [len(spec.propose(s, room=64, max_model_len=64)) for s in seqs[:6]] == [1, 1, 0, 0, 0, 0]
    spec.prepare(seqs[:6] * 2, 64)  # a full step drafts nothing
    assert spec.propose(seqs[0], room=64, max_model_len=64) == []


def test_settings_are_checked_by_name():
    with pytest.raises(ConfigError, match="EXPERT_SPECULATIVE"):
        EngineConfig.from_env({"EXPERT_SPECULATIVE": "medusa"})
    with pytest.raises(ConfigError, match="EXPERT_SPECULATIVE_K"):
        EngineConfig.from_env({"EXPERT_SPECULATIVE_K": "0"})
    with pytest.raises(ConfigError, match="EXPERT_SPECULATIVE_MAX_ROWS"):
        EngineConfig.from_env({"EXPERT_SPECULATIVE_MAX_ROWS": "0"})
    config = EngineConfig.from_env(
        {"EXPERT_SPECULATIVE": "ngram", "EXPERT_SPECULATIVE_K": "6", "EXPERT_SPECULATIVE_MAX_ROWS": "32"}
    )
    sched = config.scheduler
    assert (sched.speculative, sched.speculative_k, sched.speculative_max_rows) == ("ngram", 6, 32)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(speculative="yes")
    assert err.value.field == "speculative"


# -- exactness on the tiny model ---------------------------------------------------------------------


def test_greedy_output_is_identical_in_a_mixed_batch(engines):
    ordinary, speculative = engines
    # Every other request opts out: speculative and ordinary sequences share each step.
    params = [dataclasses.replace(GREEDY, speculative=False if i % 2 else None) for i in range(len(PROMPTS))]
    before = _drafted(speculative)
    assert _results(speculative.generate(PROMPTS, params)) == _results(ordinary.generate(PROMPTS, GREEDY))
    drafted, accepted = (now - then for now, then in zip(_drafted(speculative), before, strict=True))
    assert drafted > 0 and accepted > 0, "the drafter must have proposed and kept tokens"
    _assert_blocks_returned(speculative)


def test_seeded_sampling_with_penalties_and_logprobs_is_identical(engines):
    ordinary, speculative = engines
    params = [
        SamplingParams(
            temperature=0.7, top_k=8, seed=100 + i, max_tokens=16, logprobs=2, repetition_penalty=1.1
        )
        for i in range(len(PROMPTS))
    ]
    assert _results(speculative.generate(PROMPTS, params)) == _results(ordinary.generate(PROMPTS, params))
    _assert_blocks_returned(speculative)


def test_stop_strings_stop_tokens_and_max_tokens_stay_exact(engines):
    ordinary, speculative = engines
    reference = ordinary.generate(PROMPTS, GREEDY)
    params = []
    for out in reference:  # stop inside each greedy output: at a string, a token, or max_tokens
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        stop = [text[len(text) // 2 : len(text) // 2 + 2]] if len(text.strip()) > 4 else []
        params.append(dataclasses.replace(GREEDY, stop=stop, stop_token_ids=[ids[7]], max_tokens=11))
    got = _results(speculative.generate(PROMPTS, params))
    assert got == _results(ordinary.generate(PROMPTS, params))
    assert {r[2] for r in got} >= {"stop"}
    _assert_blocks_returned(speculative)


def test_structured_output_stays_exact(engines):
    ordinary, speculative = engines
    # A regex whose repeats the drafter finds in the output; a draft the format refuses is cut.
    fmt = StructuredOutput("regex", "(ab|cd)(ab|cd)(ab|cd)(ab|cd)(ab|cd)(ab|cd)(ab|cd)x")
    params = dataclasses.replace(GREEDY, structured=fmt, ignore_eos=False, max_tokens=40)
    sampled = [dataclasses.replace(params, temperature=0.9, seed=s) for s in range(4)]
    prompts = PROMPTS[:4]
    before = _drafted(speculative)
    assert _results(speculative.generate(prompts * 2, [params] * 4 + sampled)) == _results(
        ordinary.generate(prompts * 2, [params] * 4 + sampled)
    )
    assert _drafted(speculative)[1] > before[1], "drafts must have been kept under the format"
    _assert_blocks_returned(speculative)


def test_session_turns_stay_exact_and_keep_their_kv(engines):
    results = []
    before = _drafted(engines[1])
    for engine in engines:
        history: list[int] = []
        texts = []
        for turn, prompt in enumerate(PROMPTS[:3]):
            ids = history + prompt
            ref = SessionRef(f"s-{id(engine)}", history_tokens=len(history))
            engine.add_request(f"turn-{id(engine)}-{turn}", ids, GREEDY, session=ref)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final = out
            texts.append(final.outputs[0].token_ids)
            history = ids + final.outputs[0].token_ids
        results.append(texts)
        assert engine.end_session(f"s-{id(engine)}")
        _assert_blocks_returned(engine)
    assert results[0] == results[1]
    assert _drafted(engines[1])[1] > before[1]


def test_preemption_under_a_small_pool_stays_exact(tiny_llama, engines):
    ordinary, _ = engines
    small = _engine(tiny_llama, "ngram", num_blocks=28)
    long = dataclasses.replace(GREEDY, max_tokens=32)
    got = small.generate(PROMPTS, long)
    assert small.get_stats().num_preemptions_total > 0, "the pool must be small enough to preempt"
    assert _drafted(small)[1] > 0
    assert _results(got) == _results(ordinary.generate(PROMPTS, long))
    _assert_blocks_returned(small)


def test_expert_requests_stay_exact_beside_plain_ones(engines, tiny_llama, tmp_path_factory):
    from tests.helpers.experts import Publisher
    from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter

    root = tmp_path_factory.mktemp("spec-experts")
    publisher = Publisher.create(root / "publisher")
    adapters = {
        "lora": write_lora_adapter(tiny_llama, root / "lora", seed=1),
        "ia3": write_ia3_adapter(tiny_llama, root / "ia3", seed=3),
    }
    packages = [publisher.pack(d, tiny_llama, root / f"{n}.expert", n) for n, d in adapters.items()]
    for engine in engines:
        for package in packages:
            engine.load_expert(package, publisher.trusted)
    experts = [[("lora", 1.0)], None, [("lora", 0.5), ("ia3", 1.0)], None, [("ia3", 1.0)], None, None]
    ordinary, speculative = engines
    before = _drafted(speculative)
    got = speculative.generate(PROMPTS, GREEDY, experts=experts)
    assert _results(got) == _results(ordinary.generate(PROMPTS, GREEDY, experts=experts))
    assert _drafted(speculative)[1] > before[1]
    _assert_blocks_returned(speculative)


# -- the distribution ---------------------------------------------------------------------------------


def test_sampled_tokens_follow_the_target_distribution(engines):
    """Independent seeds in each arm, so this tests the distribution, not equal draws. The first two
    output positions (where drafts are verified) are compared; with a threshold of 0.001 per test
    and fixed seeds, a correct engine raises a false alarm in about 2 of 1,000 seed choices."""
    ordinary, speculative = engines
    prompt = [40, 41, 42, 43] * 5
    n = 300
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    arms = []
    for engine, offset in ((ordinary, 0), (speculative, 10_000)):
        outs = engine.generate([prompt] * n, [dataclasses.replace(params, seed=offset + s) for s in range(n)])
        arms.append([tuple(o.outputs[0].token_ids) for o in outs])
    assert _drafted(speculative)[0] > 0
    for position in (0, 1):
        first = [Counter(seq[position] for seq in arm) for arm in arms]
        assert chi_square_p(*first) > 0.001, f"position {position}: {first}"
    _assert_blocks_returned(speculative)


# -- the default model ---------------------------------------------------------------------------------


def test_default_model_extraction_is_identical_and_accepts_drafts(default_model):
    para = (
        "Invoice INV-2291 was issued by Acme Corp on 12 March 2024 to Bob Smith for 431.50 EUR, "
        "payable within 30 days to account DE44 5001 0517 5407 3249 31."
    )
    chats = [
        [{"role": "user", "content": f"Copy the account number from this text: {para}"}],
        [{"role": "user", "content": f"Return JSON with the invoice number and the customer: {para}"}],
        [{"role": "user", "content": "Name three colours."}],
    ]
    schema = StructuredOutput("json_schema", json.dumps({"properties": {"invoice": {"type": "string"}}}))
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20, structured=schema),
        SamplingParams(temperature=0.0, max_tokens=8),
    ]
    # One engine: a request that turns speculation off decodes as an engine without it would.
    engine = LLMEngine.from_pretrained(str(default_model), num_blocks=64, speculative="ngram")
    off = [dataclasses.replace(p, speculative=False) for p in params]
    # The third request runs ordinary decoding beside the speculative ones in both batches.
    assert _results(engine.chat(chats, params[:2] + off[2:])) == _results(engine.chat(chats, off))
    assert engine.get_stats().speculative.accepted_tokens_total > 0
    _assert_blocks_returned(engine)
