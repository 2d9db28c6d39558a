"""Structured output inside the engine's batches: JSON schemas on the default model (every output
valid, and unchanged where the model already conformed), regexes and grammars, and the
combinations: mixed batches (batch invariance), experts, n > 1, preemption and refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from libs.engine import InvalidRequestError, LLMEngine, SamplingParams
from libs.structured_output import StructuredOutput, text_problem
from tests.helpers.experts import Publisher
from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter, write_prompt_tuning_adapter

CASES = json.loads((Path(__file__).resolve().parents[2] / "bench/data/structured_cases.json").read_text())

# A regex the tiny random model cannot run away in: every output is at most 20 bytes.
EMAIL = StructuredOutput("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
ENUM_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "bb", "ccc"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["kind", "n"],
}
ENUMS = StructuredOutput("json_schema", json.dumps(ENUM_SCHEMA))
TINY_FORMATS = [EMAIL, ENUMS]


def _conforms(text: str, schema: dict) -> bool:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(document)


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def smollm(default_model) -> LLMEngine:
    return LLMEngine.from_pretrained(str(default_model), max_model_len=1024, num_blocks=512, max_num_seqs=64)


@pytest.mark.default_model
def test_fifty_prompts_over_five_schemas_all_validate_and_conforming_outputs_are_unchanged(smollm):
    prompts = [_chat(case["prompt"]) for case in CASES["cases"]]
    schemas = [CASES["schemas"][case["schema"]] for case in CASES["cases"]]
    assert len(prompts) == 50 and len({json.dumps(s) for s in schemas}) == 5
    free = smollm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=160))
    constrained = smollm.generate(
        prompts,
        [
            SamplingParams(
                temperature=0.0, max_tokens=160, structured=StructuredOutput("json_schema", json.dumps(s))
            )
            for s in schemas
        ],
    )
    conforming = 0
    for schema, before, after in zip(schemas, free, constrained, strict=True):
        text = after.outputs[0].text
        assert after.outputs[0].finish_reason == "stop", text
        assert _conforms(text, schema), text
        if _conforms(before.outputs[0].text, schema):
            conforming += 1
            assert text == before.outputs[0].text  # the mask changed nothing it did not need to
    # Half the prompts show the shape; the model follows it often enough for the check to bite.
    assert conforming >= 10
    assert sum(not _conforms(o.outputs[0].text, s) for o, s in zip(free, schemas, strict=True)) >= 10


REGEXES = [
    ("Is Paris the capital of France? Answer yes or no.", r"(yes|no)"),
    ("What is 12 plus 30? Answer with the number only.", r"[0-9]{1,4}"),
    (
        "When did the Second World War end in Europe? Give the date as YYYY-MM-DD.",
        r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    ),
    ("Make up a US phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("Name a primary colour in lower case.", r"(red|blue|yellow)"),
]

# A sum of three small numbers; the same language as a Python regex, for an independent check.
SUMS = 'start: sum\nsum: NUMBER " + " NUMBER " + " NUMBER\nNUMBER: /[0-9]{1,3}/\n'
SUMS_RE = r"[0-9]{1,3}( \+ [0-9]{1,3}){2}"
# One or two key=value pairs separated by a semicolon.
PAIRS = 'start: pair | pair ";" pair\npair: KEY "=" VALUE\nKEY: /[a-z]{1,10}/\nVALUE: /[0-9a-z]{1,10}/\n'
PAIRS_RE = r"[a-z]{1,10}=[0-9a-z]{1,10}(;[a-z]{1,10}=[0-9a-z]{1,10})?"


@pytest.mark.default_model
def test_regex_and_grammar_outputs_match(smollm):
    requests = [(_chat(p), StructuredOutput("regex", r), r) for p, r in REGEXES] + [
        (_chat("Write a sum of three small numbers."), StructuredOutput("grammar", SUMS), SUMS_RE),
        (_chat("Write two settings as key=value pairs."), StructuredOutput("grammar", PAIRS), PAIRS_RE),
    ]
    outputs = smollm.generate(
        [r[0] for r in requests],
        [SamplingParams(temperature=0.0, max_tokens=48, structured=r[1]) for r in requests],
    )
    for (_, structured, pattern), out in zip(requests, outputs, strict=True):
        text = out.outputs[0].text
        assert re.fullmatch(pattern, text), (structured.spec, text)
        assert text_problem(structured, text) is None
        assert out.outputs[0].finish_reason == "stop"
    assert outputs[0].outputs[0].text == "yes"


def _tiny_prompts(count: int) -> list[str]:
    return [f"prompt number {i} says {'hello ' * (i % 5)}there" for i in range(count)]


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=200, max_num_seqs=32)


def _matches(structured: StructuredOutput, text: str) -> bool:
    if structured is EMAIL:
        return re.fullmatch(structured.spec, text) is not None
    return _conforms(text, ENUM_SCHEMA)


def test_constrained_rows_leave_the_other_rows_bitwise_unchanged(tiny):
    prompts = _tiny_prompts(12)
    plain = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=6, max_tokens=24, logprobs=2, ignore_eos=True),
    ]
    free_params = [plain[i % 3] for i in range(6)]
    alone = tiny.generate(prompts[:6], free_params)
    constrained_params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=200, structured=TINY_FORMATS[i % 2])
        for i in range(6)
    ]
    constrained_alone = tiny.generate(prompts[6:], constrained_params)
    mixed = tiny.generate(prompts, free_params + constrained_params)
    for a, m in zip(alone, mixed[:6], strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].logprobs == a.outputs[0].logprobs
    for a, m, p in zip(constrained_alone, mixed[6:], constrained_params, strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids  # constrained rows are batch-invariant too
        assert _matches(p.structured, m.outputs[0].text), m.outputs[0].text


def test_every_choice_of_an_n_3_request_follows_its_format(tiny):
    for structured in TINY_FORMATS:
        out = tiny.generate(
            [_tiny_prompts(1)[0]],
            SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=200, structured=structured),
        )[0]
        texts = [c.text for c in out.outputs]
        assert len(texts) == 3 and len(set(texts)) > 1, texts  # the forks went their own ways
        assert all(_matches(structured, t) for t in texts), texts
        assert all(c.finish_reason == "stop" for c in out.outputs)


def test_preemption_under_a_tiny_pool_keeps_constrained_outputs(tiny_llama, tiny):
    prompts = [p * 2 for p in _tiny_prompts(8)]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=180, structured=TINY_FORMATS[i % 2])
        for i in range(8)
    ]
    expected = [o.outputs[0].token_ids for o in tiny.generate(prompts, params)]
    small = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=20, block_size=16)
    outputs = small.generate(prompts, params)
    assert small.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(_matches(p.structured, o.outputs[0].text) for p, o in zip(params, outputs, strict=True))


def test_a_constrained_request_with_experts_follows_its_format(tiny_llama, tmp_path):
    publisher = Publisher.create(tmp_path / "publisher")
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=100)
    adapters = {
        "lora": write_lora_adapter(tiny_llama, tmp_path / "lora", r=4, seed=1),
        "ia3": write_ia3_adapter(tiny_llama, tmp_path / "ia3", seed=2),
        "soft": write_prompt_tuning_adapter(tiny_llama, tmp_path / "soft", num_virtual_tokens=3, seed=3),
    }
    for name, peft in adapters.items():
        engine.load_expert(
            publisher.pack(peft, tiny_llama, tmp_path / f"{name}.expert", name), publisher.trusted
        )
    prompts = _tiny_prompts(6)
    experts = [["lora"], ["ia3"], ["soft"], ["lora", "ia3"], None, ["lora"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=200, structured=TINY_FORMATS[i % 2])
        for i in range(len(prompts))
    ]
    together = engine.generate(prompts, params, experts=experts)
    for prompt, p, spec, out in zip(prompts, params, experts, together, strict=True):
        assert _matches(p.structured, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].token_ids == engine.generate([prompt], p, experts=spec)[0].outputs[0].token_ids
    with_expert = engine.generate([prompts[0]], params[0], experts=["lora"])[0].outputs[0].text
    without = engine.generate([prompts[0]], params[0])[0].outputs[0].text
    assert with_expert != without  # the expert still changes what is said within the format


def test_max_tokens_cuts_a_format_short_with_finish_reason_length(tiny):
    long_enough = StructuredOutput("regex", r"[a-z]{40}")
    out = tiny.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3, structured=long_enough))[0]
    assert out.outputs[0].finish_reason == "length"
    assert text_problem(long_enough, out.outputs[0].text) == "ends before the format is complete"


def test_the_end_token_comes_only_where_the_format_can_end(tiny):
    eos = next(iter(tiny.tokenizer.eos_token_ids))
    # A regex that may end after any letter: the end token is allowed there, and a greedy model
    # that ends ends with "stop"; a regex that needs 10 letters never ends sooner.
    out = tiny.generate(
        ["hello"],
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=64, structured=StructuredOutput("regex", r"[a-z]{10}")
        ),
    )[0]
    assert len(out.outputs[0].text) == 10 and eos not in out.outputs[0].token_ids


def test_a_format_the_library_refuses_names_the_field(tiny):
    for structured in [
        StructuredOutput("regex", "[a-z"),
        StructuredOutput("grammar", "start: missing_rule\n"),
        StructuredOutput("json_schema", '{"not": {"type": "string"}}'),
        StructuredOutput("json_schema", "[1, 2]"),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            tiny.generate(["hello"], SamplingParams(max_tokens=4, structured=structured))
        assert refused.value.field == "structured"
    assert tiny.get_stats().kv_used_blocks == 0


def test_a_compiled_format_is_reused(tiny):
    structured = StructuredOutput("regex", r"(cached|reused){1,3}")
    before = (tiny.grammars.hits, tiny.grammars.misses)
    for _ in range(3):
        tiny.generate(["hello"], SamplingParams(max_tokens=30, structured=structured))
    assert (tiny.grammars.hits - before[0], tiny.grammars.misses - before[1]) == (2, 1)


def test_a_stop_string_ends_a_constrained_output_where_it_appears(tiny):
    structured = StructuredOutput("regex", r"(ab|cd){3,12}")
    free = tiny.generate(
        ["hello"], SamplingParams(temperature=1.0, seed=8, max_tokens=40, structured=structured)
    )[0]
    text = free.outputs[0].text
    assert re.fullmatch(structured.spec, text), text
    stop = text[4:6]  # the third pair: the output stops just before it
    cut = tiny.generate(
        ["hello"], SamplingParams(temperature=1.0, seed=8, max_tokens=40, structured=structured, stop=[stop])
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]


def test_a_constrained_request_reuses_the_prefix_cache_and_keeps_its_output(tiny_llama):
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=200)
    prompt = "a shared prefix that fills several blocks of the cache " * 4
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=200, structured=ENUMS)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert second.metrics.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert _conforms(second.outputs[0].text, ENUM_SCHEMA)
