"""The selection (docs/design.md#selection-and-score) on embedded Qdrant with the real encoder: the
expert a prompt asks for, its score from the design's weights, force/exclude/max_experts,
incompatibilities, composition order, feedback changing the ranking, and the base-model fallback."""

from __future__ import annotations

import pytest

from libs.errors import ServiceError
from libs.experts.manifest import BaseModelIdentity
from libs.experts.peft_adapter import read_peft_adapter
from services.router.embedding import SentenceEncoder
from services.router.features import extract_features
from services.router.index import ExpertIndex
from services.router.matching import MatchRule, PromptQuery
from services.router.selection import score, select_experts, vram_mb
from tests.helpers.manifests import manifest_for
from tests.helpers.peft_adapters import write_all_adapters

# name: (adapter kind, description, keywords, examples, task types, capabilities, incompatible, priority)
EXPERTS = {
    "json-parser": (
        "lora",
        "Parses JSON documents and extracts the fields asked for.",
        ("json", "parse"),
        ("Extract the name and email from this JSON object.",),
        ("json_parsing",),
        ("json",),
        (),
        0,
    ),
    "json-pro": (
        "lora",
        "Extracts fields from JSON payloads and validates JSON structure.",
        ("json", "fields"),
        ("Pull the id field out of this JSON record.",),
        ("json_parsing",),
        ("json",),
        (),
        0,
    ),
    "sql-writer": (
        "ia3",
        "Writes SQL queries for relational databases.",
        ("sql", "query"),
        ("Write a SQL query that counts orders per customer.",),
        ("code_generation",),
        (),
        ("python-coder",),
        5,
    ),
    "python-coder": (
        "lora",
        "Writes Python functions and scripts.",
        ("python", "function"),
        ("Write a Python function that reverses a list.",),
        ("code_generation",),
        ("code",),
        (),
        1,
    ),
    "french": (
        "soft_prompt",
        "Answers in French and translates English text into French.",
        ("french",),
        ("Translate this sentence into French.",),
        ("translation",),
        ("language:fr",),
        (),
        0,
    ),
}


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder.from_package()


@pytest.fixture
def index(tiny_llama, tmp_path, encoder, expert_stats):
    adapters = {
        kind: read_peft_adapter(path)
        for kind, path in write_all_adapters(tiny_llama, tmp_path / "peft").items()
    }
    base = BaseModelIdentity.from_dir(tiny_llama)
    client = ExpertIndex.connect(data_dir=tmp_path)
    index = ExpertIndex(client, encoder, expert_stats)
    for name, (kind, description, keywords, examples, tasks, caps, incompatible, priority) in EXPERTS.items():
        manifest = manifest_for(
            adapters[kind],
            base,
            name=name,
            description=description,
            keywords=keywords,
            examples=examples,
            task_types=tasks,
            capabilities=caps,
            incompatible_with=incompatible,
            priority=priority,
        )
        index.register(manifest, content_hash=f"{len(name):064x}", weight_bytes=(4 << 20))
    yield index
    client.close()


def select(index, encoder, prompt, **kwargs):
    return select_experts(extract_features(prompt), PromptQuery.encode(encoder, prompt), index, **kwargs)


def test_a_json_prompt_selects_a_json_expert_with_the_seeds_score(index, encoder):
    selection = select(index, encoder, 'Parse this JSON and extract the email field: {"email": "a@b.c"}')
    names = [c.expert.name for c in selection.chosen]
    assert names and names[0].startswith("json-")
    best = selection.considered[0]
    assert best.score == pytest.approx(score(best.similarity, best.expert.success_rate, vram_mb(best.expert)))
    assert best.score == pytest.approx(0.5 * best.similarity + 0.3 * 0.5 + 0.2 * (1 - 4 / 100))
    assert any(line.startswith(f"candidate {best.expert.name}@1.0.0 score") for line in selection.trace)


def test_a_sql_prompt_selects_the_sql_expert(index, encoder):
    selection = select(index, encoder, "Write a SQL query that lists customers with more than three orders.")
    assert selection.considered[0].expert.name == "sql-writer"


def test_an_unrelated_prompt_falls_back_to_the_base_model(index, encoder):
    selection = select(index, encoder, "What colour are flamingos?")
    assert selection.fallback and selection.trace[-1].startswith("no suitable expert")


def test_incompatible_experts_are_not_chosen_together(index, encoder):
    selection = select(index, encoder, "Write a Python function that builds a SQL query string.")
    names = {c.expert.name for c in selection.chosen}
    assert not {"sql-writer", "python-coder"} <= names
    assert any("incompatible with" in line for line in selection.trace)


def test_force_exclude_and_max_experts(index, encoder):
    prompt = "Parse this JSON and extract the email field."
    forced = select(index, encoder, prompt, force=["french"])
    assert "french" in [c.expert.name for c in forced.chosen]
    excluded = select(index, encoder, prompt, exclude=["json-parser", "json-pro"])
    assert not {"json-parser", "json-pro"} & {c.expert.name for c in excluded.chosen}
    assert len(select(index, encoder, prompt, max_experts=1).chosen) == 1


def test_a_weak_neighbour_is_not_composed_with_the_leader(index, encoder):
    """Both JSON experts pass their floors; a companion ratio of 1 keeps only the leader, naming why,
    and 0 composes both (the original design)."""
    prompt = "Parse this JSON and extract the email field."
    every = ExpertIndex(index.client, encoder, index.stats, matching=MatchRule(companion_ratio=0.0))
    assert {"json-parser", "json-pro"} <= {c.expert.name for c in select(every, encoder, prompt).chosen}
    alone = ExpertIndex(index.client, encoder, index.stats, matching=MatchRule(companion_ratio=1.0))
    selection = select(alone, encoder, prompt)
    (leader,) = selection.chosen
    runner_up = next(c for c in selection.considered if c.expert.name != leader.expert.name)
    assert runner_up.similarity < leader.similarity
    assert any(line.startswith(f"{runner_up.expert.name}: similarity ") for line in selection.trace)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"force": ["french", "nobody"]}, "request.force_experts[1]"),
        ({"force": ["french"], "exclude": ["french"]}, "request.exclude_experts[0]"),
        ({"force": ["french", "json-pro"], "max_experts": 1}, "request.force_experts"),
        ({"force": ["sql-writer", "python-coder"]}, "request.force_experts[1]"),
    ],
)
def test_impossible_requests_are_refused_naming_the_field(index, encoder, kwargs, field):
    with pytest.raises(ServiceError) as refused:
        select(index, encoder, "Write a Python function.", **kwargs)
    assert field in [f for f, _ in refused.value.violations]


def test_only_experts_of_the_requests_base_model_are_candidates(index, encoder, tiny_llama):
    prompt = "Write a SQL query that lists customers with more than three orders."
    ours = BaseModelIdentity.from_dir(tiny_llama).config_hash
    assert select(index, encoder, prompt, base_model_hash=ours).considered[0].expert.name == "sql-writer"
    other = "0" * 64  # another model: none of these experts' weights fit it
    selection = select(index, encoder, prompt, base_model_hash=other)
    assert selection.fallback and not selection.considered
    assert "sql-writer: trained for another base model, not a candidate" in selection.trace
    with pytest.raises(ServiceError) as refused:
        select(index, encoder, prompt, base_model_hash=other, force=["sql-writer"])
    assert refused.value.violations == (
        (
            "request.force_experts[0]",
            "'sql-writer' was trained for another base model than the one this request runs on",
        ),
    )


def test_soft_prompts_come_first_then_by_priority(index, encoder):
    selection = select(index, encoder, "Write a SQL query.", force=["french", "sql-writer", "json-pro"])
    assert [c.expert.name for c in selection.chosen] == ["french", "sql-writer", "json-pro"]


def test_failed_feedback_lets_a_competitor_overtake(index, encoder):
    prompt = "Get the fields out of this JSON."
    first, second = select(index, encoder, prompt).considered[:2]
    # Within feedback's reach: the success rate's term can move a score by at most 0.30 x 0.5.
    assert {first.expert.name, second.expert.name} == {"json-parser", "json-pro"}
    assert first.score - second.score < 0.15
    for _ in range(10):
        index.record_outcome(first.expert.name, False, alpha=0.2)
    assert select(index, encoder, prompt).considered[0].expert.name == second.expert.name


# Experts known only by a description and keywords, as `expertctl expert pack` makes them without
# examples: the first scenario the calibrated floors were made for.
DESCRIBED = {
    "french-translate": ("Translates English text into French.", ("french", "translation")),
    "regex-writer": (
        "Writes regular expressions that match the patterns you describe.",
        ("regex", "pattern"),
    ),
    "summarize": (
        "Summarizes long articles, emails and documents into a few sentences.",
        ("summary", "tl;dr"),
    ),
    "sql-helper": ("Writes SQL queries for a database schema you give.", ("sql", "query", "database")),
}
DESCRIBED_PROMPTS = {
    "french-translate": "How do I say 'the train leaves at noon' in French?",
    "regex-writer": "I need a regular expression that matches UK postcodes.",
    "summarize": "Give me a two-sentence summary of this article: The council approved a new park.",
    "sql-helper": "Write a SQL query that counts the orders per customer in orders(id, customer_id).",
}
UNRELATED = ("What colour are flamingos?", "Tell me a joke about cats.", "How long should I boil an egg?")
# About an expert's subject, not a task for it: the topic gate's case.
ABOUT_THE_TOPIC = {
    "french-translate": "Is French a hard language for English speakers to learn?",
    "regex-writer": "Who invented regular expressions?",
}


@pytest.fixture
def described(tiny_llama, tmp_path, encoder, expert_stats):
    lora = read_peft_adapter(write_all_adapters(tiny_llama, tmp_path / "peft")["lora"])
    client = ExpertIndex.connect(data_dir=tmp_path)
    index = ExpertIndex(client, encoder, expert_stats)
    for name, (description, keywords) in DESCRIBED.items():
        manifest = manifest_for(
            lora,
            BaseModelIdentity.from_dir(tiny_llama),
            name=name,
            description=description,
            keywords=keywords,
        )
        index.register(manifest, content_hash=f"{len(name):064x}", weight_bytes=4 << 20)
    yield index
    client.close()


@pytest.mark.parametrize("name", sorted(DESCRIBED_PROMPTS))
def test_an_expert_known_only_by_its_description_is_found_first(described, encoder, name):
    selection = select(described, encoder, DESCRIBED_PROMPTS[name])
    assert selection.considered and selection.considered[0].expert.name == name, selection.trace


@pytest.mark.parametrize("prompt", UNRELATED)
def test_unrelated_prompts_get_no_described_expert(described, encoder, prompt):
    assert select(described, encoder, prompt).fallback


@pytest.mark.parametrize("name", sorted(ABOUT_THE_TOPIC))
def test_a_question_about_an_experts_topic_gets_no_expert_and_the_trace_says_why(described, encoder, name):
    selection = select(described, encoder, ABOUT_THE_TOPIC[name])
    assert selection.fallback, selection.trace
    reason = f"{name}: not taken by retrieval, the prompt is about its topic"
    assert any(line.startswith(reason) for line in selection.trace)
    ungated = ExpertIndex(described.client, encoder, described.stats, matching=MatchRule(topic_gate=False))
    assert [c.expert.name for c in select(ungated, encoder, ABOUT_THE_TOPIC[name]).chosen][:1] == [name]


def test_the_seeds_fixed_floor_misses_what_the_calibrated_floors_find(described, encoder):
    from services.router.calibration import FloorRule

    fixed = ExpertIndex(described.client, encoder, described.stats, FloorRule(fixed=0.6))
    found = {name: not select(fixed, encoder, prompt).fallback for name, prompt in DESCRIBED_PROMPTS.items()}
    assert not all(found.values())  # why the floor is calibrated: 0.6 turns most of these away
