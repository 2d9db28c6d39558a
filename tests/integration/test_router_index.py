"""The router's expert index on embedded Qdrant (qdrant-client local mode, on disk) with the real
sentence encoder and a real Redis for the feedback statistics: registration, retrieval by meaning
with k = 30 and each expert's floor, feedback as an exponential moving average from a prior,
and a registry that survives reopening."""

from __future__ import annotations

import pytest
import torch

from libs.experts.manifest import BaseModelIdentity
from libs.experts.peft_adapter import read_peft_adapter
from services.router.embedding import SentenceEncoder
from services.router.index import ExpertIndex, point_id
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
        return manifest_for(
            lora,
            base,
            name=name,
            version=version,
            description=description,
            keywords=keywords,
            examples=examples,
            **extra,
        )

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
        found = index.search(encoder.encode([prompt])[0], tags, k=30)
        assert found and found[0][0].name == expected, (prompt, [(e.name, round(s, 3)) for e, s in found])
        assert all(score >= tags.floors[e.name] for e, score in found)


def test_an_unrelated_prompt_finds_nothing_above_the_floors(index, manifests, encoder):
    for name in SKILLS:
        index.register(manifests(name), content_hash=name[0] * 64, weight_bytes=1000)
    assert index.search(encoder.encode(["What colour are flamingos?"])[0], index.routing_tags(), k=30) == []


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
    prompt = encoder.encode(["Extract the email field from this JSON."])[0]
    (stored,) = index.client.retrieve("experts", ids=[point_id("json-parser")], with_vectors=True)
    expected = float(torch.tensor(stored.vector) @ prompt)
    similarity = other.routing_tags().similarity(prompt, ["json-parser", "nobody"])
    assert similarity == {"json-parser": pytest.approx(expected)}

    index.remove("sql-writer")
    assert other.routing_tags().tagged(["code_generation"], []) == set()
    assert other.routing_tags().similarity(prompt, ["sql-writer"]) == {}


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
