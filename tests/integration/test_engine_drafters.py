"""Speculative decoding with model drafters (base, int4, draft:<path>) and the n-gram drafter.

Greedy output with each drafter equals decoding without speculation on the default model, with
and without experts, in batches that mix speculative and ordinary requests. Sampled output follows
the target's distribution: two-sample tests against ordinary sampling on a tiny generated model
with a tiny generated draft (its weights the target's plus noise, so drafts are often but not always
accepted and both branches of the rejection rule run). Real engines, real checkpoints throughout.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from libs.config import ConfigError
from libs.engine.llm_engine import LLMEngine
from libs.engine.sampling_params import SamplingParams
from libs.engine.sessions import SessionRef
from libs.structured_output import StructuredOutput
from tests.helpers.draft_checkpoint import write_noisy_draft, write_tiny_draft
from tests.helpers.statistics import chi_square_p

# A repeated pattern: the n-gram drafter finds it, and the draft model continues it like the target.
PROMPT = [40, 41, 42, 43] * 5
# Below this p-value a two-sample test fails. Each drafter runs two tests on fixed seeds; for a
# correct engine each fails with probability 0.001 over seed choices, so a false alarm in this
# module has probability below 0.006 (three drafters, two tests each).
ALPHA = 0.001


def _engine(model, speculative: str, **overrides) -> LLMEngine:
    settings = {"device": "cpu", "num_blocks": 480, "block_size": 4, "seed": 0, "speculative": speculative}
    settings["speculative_max_rows"] = 256  # every sequence drafts: these batches test verification
    return LLMEngine.from_pretrained(str(model), **(settings | overrides))


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama, tmp_path_factory):
    return write_noisy_draft(tiny_llama, tmp_path_factory.mktemp("noisy-draft"), noise=0.3, seed=1)


@pytest.fixture(scope="module")
def tiny_engines(tiny_llama, noisy_draft):
    """The ordinary engine and one per drafter, on the tiny checkpoint."""
    return {
        name: _engine(tiny_llama, setting)
        for name, setting in (
            ("off", "off"),
            ("ngram", "ngram"),
            ("draft", f"draft:{noisy_draft}"),
            ("int4", "int4"),
        )
    }


def _sampled(engine: LLMEngine, params: SamplingParams, seeds: range) -> list[tuple[int, ...]]:
    outs = engine.generate([PROMPT] * len(seeds), [dataclasses.replace(params, seed=s) for s in seeds])
    return [tuple(o.outputs[0].token_ids) for o in outs]


def _blocks_returned(engine: LLMEngine) -> None:
    assert engine.kv.usage().num_used_blocks == 0
    model = engine.speculator.model if engine.speculator else None
    if model is not None:
        assert model.cache.num_used_blocks == 0 and not model.cache.slots


# -- the distribution -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("drafter", "length"), [("ngram", 5), ("draft", 4)])
def test_sampled_output_follows_the_target_distribution(tiny_engines, drafter, length):
    """Independent seeds in the two arms (so this tests distributions, not equal draws): a
    chi-square test on the first token, where the first drafts are verified, and a two-sample
    chi-square test on whole sequences."""
    ordinary, speculative = tiny_engines["off"], tiny_engines[drafter]
    # Two likely tokens per position: the outputs repeat bigrams, so the n-gram drafter drafts too
    # (from the third token on: it needs five).
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=length, ignore_eos=True)
    before = speculative.get_stats().speculative
    n = 300
    reference = _sampled(ordinary, params, range(n))
    got = _sampled(speculative, params, range(50_000, 50_000 + n))
    stats = speculative.get_stats().speculative
    drafted = stats.drafted_tokens_total - before.drafted_tokens_total
    accepted = stats.accepted_tokens_total - before.accepted_tokens_total
    assert drafted > accepted, "drafts must have been proposed and some rejected"
    if drafter == "draft":  # near the target: many of its drafts are kept
        assert accepted > 0
    first = [Counter(s[0] for s in arm) for arm in (reference, got)]
    assert chi_square_p(*first) > ALPHA, first
    whole = [Counter(arm) for arm in (reference, got)]
    assert chi_square_p(*whole) > ALPHA, whole
    _blocks_returned(speculative)


def test_seeded_sampling_with_a_model_drafter_is_reproducible(tiny_engines):
    engine = tiny_engines["draft"]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, logprobs=1)
    first = _sampled(engine, params, range(12))
    assert _sampled(engine, params, range(12)) == first
    assert len(set(first)) > 1
    _blocks_returned(engine)


# -- exactness on the tiny model --------------------------------------------------------------------------


def test_greedy_under_formats_stops_and_preemption_stays_exact(tiny_llama, tiny_engines):
    """A small pool forces preemptions (the drafter's slots are freed with them), a regex format
    refuses some drafts, stop strings and max_tokens cut verified drafts; output as without drafts.
    The int4 drafter: its greedy drafts are mostly the target's, so many are kept."""
    small = _engine(tiny_llama, "int4", num_blocks=40)
    fmt = StructuredOutput("regex", "(ab|cd)(ab|cd)(ab|cd)(ab|cd)x")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[(7 * i + j) % 50 + 20 for j in range(5)] * 4 for i in range(6)]
    params = [
        greedy,
        dataclasses.replace(greedy, structured=fmt, ignore_eos=False),
        dataclasses.replace(greedy, stop=["a"], max_tokens=11),
        dataclasses.replace(greedy, speculative=False),
        dataclasses.replace(greedy, structured=fmt, ignore_eos=False),
        greedy,
    ]
    got = [o.outputs[0] for o in small.generate(prompts, params)]
    want = [o.outputs[0] for o in tiny_engines["off"].generate(prompts, params)]
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == [
        (c.token_ids, c.text, c.finish_reason) for c in want
    ]
    assert small.get_stats().num_preemptions_total > 0, "the pool must be small enough to preempt"
    assert small.get_stats().speculative.accepted_tokens_total > 0
    _blocks_returned(small)


def test_sampled_output_under_a_format_stays_in_the_format(tiny_engines):
    """A draft the format refuses is a rejection (drawn from max(0, p - q)): outputs stay valid."""
    fmt = StructuredOutput("regex", "(ab|cd|ef)(ab|cd|ef)(ab|cd|ef)x")
    params = SamplingParams(temperature=1.0, max_tokens=20, structured=fmt)
    for out in _sampled(tiny_engines["draft"], params, range(8)):
        text = tiny_engines["draft"].tokenizer.decode(list(out))
        assert (
            len(text) == 7
            and text.endswith("x")
            and all(text[i : i + 2] in ("ab", "cd", "ef") for i in (0, 2, 4))
        )
    _blocks_returned(tiny_engines["draft"])


def test_session_turns_stay_exact_with_a_model_drafter(tiny_engines):
    """Each turn is a new sequence: the drafter's slot of the last turn is freed at its end and the
    next turn prefills the drafter again, while the model's KV is kept between turns."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = []
    for name in ("off", "int4"):
        engine, history, turns = tiny_engines[name], [], []
        for turn in range(3):
            ids = history + [(5 * turn + j) % 40 + 30 for j in range(6)] * 2
            engine.add_request(
                f"{name}-turn-{turn}", ids, greedy, session=SessionRef(f"s-{name}", len(history))
            )
            final = None
            while engine.has_unfinished_requests():
                final = next((o for o in engine.step() if o.finished), final)
            turns.append(final.outputs[0].token_ids)
            history = ids + final.outputs[0].token_ids
        assert engine.end_session(f"s-{name}")
        _blocks_returned(engine)
        results.append(turns)
    assert results[0] == results[1]
    assert tiny_engines["int4"].get_stats().speculative.accepted_tokens_total > 0


def test_drafter_settings_are_refused_clearly(tiny_llama, default_model, tmp_path):
    with pytest.raises(ConfigError, match="speculative"):
        _engine(tiny_llama, "draft:")
    with pytest.raises(ConfigError, match="int4 already"):
        _engine(tiny_llama, "int4", quantization="int4")
    with pytest.raises(ConfigError, match="cannot be read"):
        _engine(tiny_llama, f"draft:{tmp_path / 'missing'}")
    other = write_tiny_draft(default_model, tmp_path / "other-vocab")
    with pytest.raises(ConfigError, match="vocab"):
        _engine(tiny_llama, f"draft:{other}")


def test_a_byte_budget_pays_for_the_drafters_kv_cache_too(tiny_llama, tmp_path):
    """A model drafter keeps as many KV blocks as the target (it must never run short first), in
    its own shape: the budget holds both, and the engine reports a block's bytes with both."""
    budget = 1 << 20
    one_layer = write_tiny_draft(tiny_llama, tmp_path / "one-layer")  # half the tiny model's KV per token
    settings = {"device": "cpu", "kv_cache_bytes": budget}
    engines = {
        name: LLMEngine.from_pretrained(str(tiny_llama), speculative=setting, **settings)
        for name, setting in (("off", "off"), ("int4", "int4"), ("draft", f"draft:{one_layer}"))
    }
    blocks, per_block = {}, {}
    for name, engine in engines.items():
        target = engine.runner.kv_cache
        blocks[name] = target.shape[2]  # the null block included
        used = target.numel() * target.element_size()
        if name != "off":
            layers = engine.speculator.model.cache.layers
            assert all(k.shape[0] == v.shape[0] == blocks[name] for k, v in layers)
            used += sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        per_block[name] = engine.model_info.kv_bytes_per_block
        assert per_block[name] * blocks[name] == used <= budget < per_block[name] * (blocks[name] + 1), name
    assert per_block["int4"] == 2 * per_block["off"]  # the same shape again
    assert per_block["draft"] * 2 == per_block["off"] * 3  # one layer of two more
    assert blocks["int4"] == budget // (2 * per_block["off"])


# -- the default model ---------------------------------------------------------------------------------

TOPICS = [
    "the sea",
    "bread",
    "a bicycle",
    "rain",
    "the moon",
    "coffee",
    "trees",
    "a library",
    "snow",
    "music",
    "a train",
    "honey",
    "mountains",
    "a clock",
    "salt",
    "the wind",
    "a bridge",
    "tea",
    "stars",
    "a river",
]


@pytest.fixture(scope="module")
def default_expert(default_model, tmp_path_factory):
    """A signed LoRA expert for the default model: (package, trusted keys)."""
    from tests.helpers.experts import Publisher
    from tests.helpers.peft_adapters import write_lora_adapter

    root = tmp_path_factory.mktemp("drafter-expert")
    publisher = Publisher.create(root / "publisher")
    adapter = write_lora_adapter(default_model, root / "lora", r=4, seed=5)
    return publisher.pack(adapter, default_model, root / "style.expert", "style"), publisher.trusted


@pytest.fixture(scope="module")
def tiny_default_draft(default_model, tmp_path_factory):
    return write_tiny_draft(default_model, tmp_path_factory.mktemp("tiny-default-draft"))


@pytest.mark.default_model
@pytest.mark.parametrize("drafter", ["ngram", "base", "int4", "draft"])
def test_default_model_greedy_is_identical_with_each_drafter(
    default_model, default_expert, tiny_default_draft, drafter
):
    """20 prompts, every third with an expert, each twice in one batch: speculating and not (the
    reference, decoded beside the speculative requests as an engine without a drafter would)."""
    setting = f"draft:{tiny_default_draft}" if drafter == "draft" else drafter
    engine = LLMEngine.from_pretrained(
        str(default_model), num_blocks=64, max_model_len=128, speculative=setting, speculative_max_rows=256
    )  # every sequence of the batch drafts, whatever the row budget a CPU step pays off up to
    engine.load_expert(*default_expert)
    # Plain text, no chat template: short prompts keep the prefill (and the drafter's) small. A
    # list the model goes on repeating: the n-gram drafter finds its drafts in it.
    prompts = [engine.tokenizer.encode(f"Words: {t}, {t}, {t},") for t in TOPICS]
    experts = [[("style", 1.0)] if i % 3 == 0 else None for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    off = dataclasses.replace(greedy, speculative=False)
    outs = engine.generate(prompts * 2, [greedy] * len(prompts) + [off] * len(prompts), experts=experts * 2)
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids[: len(prompts)] == ids[len(prompts) :]
    stats = engine.get_stats().speculative
    assert stats.drafted_tokens_total > 0, f"{drafter} must have drafted"
    if drafter in ("base", "int4"):  # the model itself, or nearly: greedy drafts are often kept
        assert stats.accepted_tokens_total > 0
    _blocks_returned(engine)
