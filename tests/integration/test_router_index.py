"""The router's expert index on embedded Qdrant (qdrant-client local mode, on disk) with the real
sentence encoder and a real Redis for the feedback statistics: registration, retrieval by meaning
with k = 30 and each expert's floor (by sentence, the request alone, the author's words and topic
probes), feedback as an
exponential moving average from a prior, and a registry that survives reopening."""

from __future__ import annotations

import math

import pytest
import torch

from libs.experts.manifest import BaseModelIdentity
from libs.experts.peft_adapter import read_peft_adapter
from services.router.embedding import SentenceEncoder
from services.router.index import TOPICS, ExpertIndex, expert_text, point_id
from services.router.matching import SENTENCE_MARGIN, MatchRule, PromptQuery, topic_probes
from tests.helpers.manifests import manifest_for
from tests.helpers.peft_adapters import write_all_adapters

SKILLS = {
    "json-parser": (
        "Parses JSON documents and extracts the fields asked for.",
        ("json", "parse", "extract fields"),
        ("Extract the name and email from this JSON object.", "Parse this JSON and list its keys."),
    ),
    "sql-writer": (
        "Writes SQL queries for relational databases.",
        ("sql", "query", "database"),
        ("Write a SQL query that counts orders per customer.", "Join the users and orders tables."),
    ),
    "french": (
        "Answers in French and translates English text into French.",
        ("french", "translation"),
        ("Translate this sentence into French.", "Réponds en français, s'il te plaît."),
    ),
}


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder.from_package()


@pytest.fixture(scope="module")
def manifests(tiny_llama, tmp_path_factory):
    lora = read_peft_adapter(write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))["lora"])
    base = BaseModelIdentity.from_dir(tiny_llama)

    def make(name: str, version: str = "1.0.0", **extra):
        description, keywords, examples = SKILLS[name]
        fields = {"description": description, "keywords": keywords, "examples": examples, **extra}
        return manifest_for(lora, base, name=name, version=version, **fields)

    return make


@pytest.fixture
def index(tmp_path, encoder, expert_stats):
    client = ExpertIndex.connect(data_dir=tmp_path)
    yield ExpertIndex(client, encoder, expert_stats)
    client.close()


def test_a_prompt_finds_the_expert_whose_skill_it_asks_for(index, manifests, encoder):
    for name in SKILLS:
        index.register(manifests(name), content_hash=name[0] * 64, weight_bytes=1000)
    for prompt, expected in [
        ("Parse this JSON and extract the email field.", "json-parser"),
        ("Write a SQL query listing customers with more than three orders.", "sql-writer"),
        ("Translate 'good morning, my friend' into French.", "french"),
    ]:
        tags = index.routing_tags()
        found = index.search(PromptQuery.encode(encoder, prompt), tags, k=30)
        summary = [(m.expert.name, round(m.similarity, 3)) for m in found]
        assert found and found[0].expert.name == expected, (prompt, summary)
        assert all(m.similarity >= tags.floors[m.expert.name] for m in found)
        assert not found[0].about_topic


def test_an_unrelated_prompt_finds_nothing_above_the_floors(index, manifests, encoder):
    for name in SKILLS:
        index.register(manifests(name), content_hash=name[0] * 64, weight_bytes=1000)
    query = PromptQuery.encode(encoder, "What colour are flamingos?")
    assert index.search(query, index.routing_tags(), k=30) == []


def test_the_best_sentence_counts_when_context_dilutes_the_task(index, manifests, encoder):
    """The task in the last sentence: its own embedding reaches the expert better than the whole
    prompt's, even after the sentence margin, and the match says which row it came from."""
    index.register(manifests("sql-writer"), content_hash="b" * 64, weight_bytes=10)
    prompt = (
        "We moved the shop to a new building last spring and hired two more people. "
        "Business is good and the team is happy. Write a SQL query that counts orders per customer."
    )
    query = PromptQuery.encode(encoder, prompt)
    assert query.vectors.shape[0] == 4  # the whole prompt and its three sentences
    (match,) = index.search(query, index.routing_tags(), k=30)
    whole = float(index.routing_tags().vectors[0] @ query.whole)
    assert match.row == 3 and match.cosine - SENTENCE_MARGIN > whole
    assert match.words is not None and set(match.words.words) == {"write", "sql", "queri"}
    assert match.similarity == pytest.approx(match.cosine - SENTENCE_MARGIN + match.word_bonus)


def test_the_authors_words_lift_the_similarity_by_their_weight(tmp_path, manifests, encoder, expert_stats):
    client = ExpertIndex.connect(data_dir=tmp_path)
    try:
        weighted = ExpertIndex(client, encoder, expert_stats, matching=MatchRule(word_weight=0.02))
        plain = ExpertIndex(client, encoder, expert_stats, matching=MatchRule(word_weight=0.0))
        weighted.register(manifests("sql-writer"), content_hash="b" * 64, weight_bytes=10)
        query = PromptQuery.encode(encoder, "Count the rows per customer with an SQL statement.")
        (with_words,) = weighted.search(query, weighted.routing_tags(), k=30)
        (without,) = plain.search(query, plain.routing_tags(), k=30)
        assert with_words.words.words == ("sql",) and without.words is None
        # "sql" is in the expert's text and in none of the generic prompts: ln(N / 1).
        documents = 1 + len(weighted.background.prompts)
        assert with_words.word_bonus == pytest.approx(0.02 * math.log(documents))
        assert with_words.similarity == pytest.approx(without.similarity + with_words.word_bonus)
        assert with_words.cosine == pytest.approx(without.cosine)
    finally:
        client.close()


def test_a_request_carrying_material_is_matched_by_the_request_alone(index, manifests, encoder):
    """A long pasted text outweighs the request in the whole prompt's embedding; the request alone
    (with the text cut off) counts like the whole prompt."""
    index.register(manifests("french"), content_hash="c" * 64, weight_bytes=10)
    prompt = (
        "Put this into French for me:\n"
        "The quarterly report shows revenue grew by four percent, driven by strong sales in the north "
        "region, while costs for logistics and warehousing rose faster than planned."
    )
    query = PromptQuery.encode(encoder, prompt)
    assert query.num_requests == 2
    (match,) = index.search(query, index.routing_tags(), k=30)
    assert query.source(match.row) == "request"
    assert match.cosine > float(index.routing_tags().vectors[0] @ query.whole)


def test_a_question_about_the_topic_is_gated_and_a_task_is_not(index, manifests, encoder):
    """Topic probes and the expert's own texts are stored at registration; a question about French
    is closer to a probe than to the expert and to its texts, a translation task is not."""
    index.register(manifests("french"), content_hash="c" * 64, weight_bytes=10)
    (stored,) = index.client.retrieve(TOPICS, ids=[point_id("french")], with_vectors=True)
    assert len(stored.vector["probes"]) == len(topic_probes(SKILLS["french"][1]))
    assert len(stored.vector["texts"]) == len(expert_text(manifests("french")))
    tags = index.routing_tags()
    (about,) = index.search(PromptQuery.encode(encoder, "Is French a hard language to learn?"), tags, k=30)
    assert about.about_topic and about.topic.probe >= max(about.similarity, about.topic.own_text)
    (task,) = index.search(PromptQuery.encode(encoder, "Translate into French: the cat sleeps."), tags, k=30)
    assert not task.about_topic and task.topic.probe < max(task.similarity, task.topic.own_text)
    index.remove("french")
    assert index.client.retrieve(TOPICS, ids=[point_id("french")]) == []


def test_a_prompt_carrying_material_is_a_task_and_is_not_gated(index, manifests, encoder):
    index.register(manifests("french"), content_hash="c" * 64, weight_bytes=10)
    question = "Is French a hard language to learn?"
    query = PromptQuery.encode(encoder, f"{question}\n\nFrom my textbook: the train leaves at noon.")
    assert query.carries_material
    (match,) = index.search(query, index.routing_tags(), k=30)
    assert match.topic is None and not match.about_topic


def test_an_experts_vector_weighs_its_authors_words_and_its_examples_as_two_wholes(index, manifests, encoder):
    from services.router.index import AUTHOR_SHARE

    manifest = manifests("sql-writer")
    index.register(manifest, content_hash="b" * 64, weight_bytes=10)
    (stored,) = index.client.retrieve("experts", ids=[point_id("sql-writer")], with_vectors=True)
    unit = torch.nn.functional.normalize
    author = unit(encoder.encode([manifest.description, ", ".join(manifest.keywords)]).mean(0), dim=0)
    examples = unit(encoder.encode(list(manifest.examples)).mean(0), dim=0)
    expected = unit(AUTHOR_SHARE * author + (1 - AUTHOR_SHARE) * examples, dim=0)
    assert torch.tensor(stored.vector) == pytest.approx(expected, abs=1e-5)
    index.register(manifests("french", examples=()), content_hash="c" * 64, weight_bytes=10)
    (stored,) = index.client.retrieve("experts", ids=[point_id("french")], with_vectors=True)
    french = manifests("french")
    author = unit(encoder.encode([french.description, ", ".join(french.keywords)]).mean(0), dim=0)
    assert torch.tensor(stored.vector) == pytest.approx(author, abs=1e-5)


def test_a_version_without_keywords_drops_the_topic_gate(index, manifests, encoder):
    """The router keeps the probes it read; a new registration is a new key, so it never uses the
    previous version's."""
    query = PromptQuery.encode(encoder, "Translate into French: the cat sleeps.")
    index.register(manifests("french"), content_hash="c" * 64, weight_bytes=10)
    (match,) = index.search(query, index.routing_tags(), k=30)
    assert match.topic is not None
    index.register(manifests("french", "2.0.0", keywords=()), content_hash="d" * 64, weight_bytes=10)
    assert index.client.retrieve(TOPICS, ids=[point_id("french")]) == []
    (match,) = index.search(query, index.routing_tags(), k=30)
    assert match.expert.version == "2.0.0" and match.topic is None and not match.about_topic


def test_registration_keeps_the_routing_facts(index, manifests):
    expert = index.register(manifests("json-parser"), content_hash="a" * 64, weight_bytes=1234)
    assert index.get("json-parser") == expert
    facts = (expert.version, expert.adapter_type, expert.weight_bytes, expert.uses)
    assert facts == ("1.0.0", "lora", 1234, 0)
    assert expert.keywords == ("json", "parse", "extract fields") and expert.success_rate == 0.5
    assert [e.name for e in index.list()] == ["json-parser"]
    assert index.remove("json-parser") == expert and index.find("json-parser") is None
    with pytest.raises(KeyError):
        index.get("json-parser")


def test_feedback_is_an_exponential_moving_average_from_the_prior(index, manifests):
    index.register(manifests("sql-writer"), content_hash="b" * 64, weight_bytes=10)
    rates = [
        index.record_outcome("sql-writer", success, alpha=0.5).success_rate
        for success in (True, False, False)
    ]
    assert rates == pytest.approx([0.75, 0.375, 0.1875])
    assert index.get("sql-writer").uses == 3
    assert index.record_outcome("nobody", True, alpha=0.5) is None


def test_the_same_version_again_keeps_its_stats_and_a_new_version_starts_from_the_prior(index, manifests):
    index.register(manifests("french"), content_hash="c" * 64, weight_bytes=10)
    index.record_outcome("french", False, alpha=0.5)
    assert index.register(manifests("french"), content_hash="c" * 64, weight_bytes=10).success_rate == 0.25
    renewed = index.register(manifests("french", "2.0.0"), content_hash="d" * 64, weight_bytes=10)
    assert (renewed.version, renewed.success_rate, renewed.uses) == ("2.0.0", 0.5, 0)


def test_the_registry_survives_reopening(tmp_path, encoder, manifests, expert_stats):
    client = ExpertIndex.connect(data_dir=tmp_path)
    ExpertIndex(client, encoder, expert_stats).register(
        manifests("json-parser"), content_hash="a" * 64, weight_bytes=1
    )
    client.close()
    client = ExpertIndex.connect(data_dir=tmp_path)
    try:
        assert [e.name for e in ExpertIndex(client, encoder, expert_stats).list()] == ["json-parser"]
    finally:
        client.close()


def test_every_router_sees_the_tags_another_registers_or_removes(index, manifests, encoder):
    """Two routers on one Qdrant (two indexes on one client): each keeps its own snapshot of the
    experts' vectors and tags, and a registration or removal through either moves the revision
    that makes the other rebuild its snapshot at its next lookup."""
    other = ExpertIndex(index.client, encoder, index.stats)
    index.register(manifests("sql-writer", task_types=("code_generation",)), "b" * 64, weight_bytes=10)
    assert other.routing_tags().tagged(["code_generation"], []) == {"sql-writer"}
    assert other.routing_tags().tagged([], ["json"]) == set()

    index.register(manifests("json-parser", capabilities=("json",)), "a" * 64, weight_bytes=10)
    index.record_outcome("json-parser", False, alpha=0.5)  # stats are read fresh, not from the snapshot
    (json_parser,) = other.experts(sorted(other.routing_tags().tagged(["summarization"], ["json"])))
    assert (json_parser.name, json_parser.success_rate) == ("json-parser", 0.25)
    prompt = PromptQuery.encode(encoder, "Extract the email field from this JSON. Then list the keys.")
    (stored,) = index.client.retrieve("experts", ids=[point_id("json-parser")], with_vectors=True)
    # The best of the prompt and its sentences (less their margin), plus its words in the expert's text.
    cosines = prompt.vectors @ torch.tensor(stored.vector)
    reached = max(float(cosines[0]), float(cosines[1:].max()) - SENTENCE_MARGIN)
    words = other.routing_tags().words.matches(prompt.text)["json-parser"]
    assert set(words.words) == {"json", "extract", "field"}
    expected = reached + index.matching.word_weight * words.weight
    similarity = other.routing_tags().similarity(prompt, ["json-parser", "nobody"], index.matching)
    assert similarity == {"json-parser": pytest.approx(expected)}

    index.remove("sql-writer")
    assert other.routing_tags().tagged(["code_generation"], []) == set()
    assert other.routing_tags().similarity(prompt, ["sql-writer"], index.matching) == {}


def test_two_routers_applying_200_outcomes_at_once_lose_none(index, manifests, encoder, clean_redis_url):
    """The statistics update is one Redis script: two routers (two indexes, each with its own Redis
    connection) folding 100 outcomes each into one expert at the same moment count all 200. (A read
    then a write, as before, loses updates here: both read the same count.)"""
    import threading

    import redis

    from services.router.stats import ExpertStats

    index.register(manifests("sql-writer"), content_hash="b" * 64, weight_bytes=10)
    clients = [redis.Redis.from_url(clean_redis_url) for _ in range(2)]
    routers = [ExpertIndex(index.client, encoder, ExpertStats(c, prior=0.5)) for c in clients]
    start = threading.Barrier(2)

    def apply(router: ExpertIndex, success: bool) -> None:
        start.wait()
        for _ in range(100):
            router.record_outcome("sql-writer", success, alpha=0.01)

    threads = [threading.Thread(target=apply, args=pair) for pair in zip(routers, (True, False), strict=True)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expert = index.get("sql-writer")
        assert expert.uses == 200
        # Every outcome moved the rate by 1 % of its distance to 0 or 1: it stays near the prior.
        assert 0.3 < expert.success_rate < 0.7
    finally:
        for c in clients:
            c.close()
