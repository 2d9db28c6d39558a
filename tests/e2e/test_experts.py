"""Experts through the whole system: a dozen signed packages (LoRA, IA³ and soft prompts with distinct
skills) installed with `expertctl expert install`, selected by the router over embedded Qdrant,
staged by preparation onto two engine processes, applied by the engines, and learned from.

The tiny model answers nonsense, so every JSON or code job fails validation: the feedback test
relies on that, and the tests run in file order (the feedback test last).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import grpc
import pytest
import torch

from expert_system import ExpertClient, FailedPrecondition, InvalidRequest
from libs.engine.adapters.manager import ExpertManager
from libs.engine.config import AdapterConfig
from libs.engine.models.config import ModelConfig
from libs.gen.expert.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    preparation_pb2,
    preparation_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.e2e.conftest import stack_env
from tests.helpers.experts import Publisher
from tests.helpers.peft_adapters import (
    write_ia3_adapter,
    write_lora_adapter,
    write_prompt_tuning_adapter,
)
from tools.expertctl.main import main as expertctl
from tools.stack import LocalStack

WRITERS = {"lora": write_lora_adapter, "ia3": write_ia3_adapter, "soft_prompt": write_prompt_tuning_adapter}

# name: kind, description, keywords, example prompt, task types, capabilities, incompatible with, priority
EXPERTS = {
    "json-parser": (
        "lora",
        "Parses JSON documents and extracts the fields asked for.",
        "json,parse,extract",
        "Extract the name and email fields from this JSON object.",
        "json_parsing",
        "json",
        "",
        0,
    ),
    "json-validator": (
        "ia3",
        "Checks JSON payloads and pulls fields out of JSON records.",
        "json,fields,records",
        "Pull the id field out of this JSON record.",
        "json_parsing",
        "json",
        "",
        0,
    ),
    "sql-writer": (
        "ia3",
        "Writes SQL queries for relational databases.",
        "sql,query,database",
        "Write a SQL query that counts orders per customer.",
        "code_generation",
        "",
        "python-coder",
        5,
    ),
    "python-coder": (
        "lora",
        "Writes Python functions and scripts.",
        "python,function,script",
        "Write a Python function that reverses a list.",
        "code_generation",
        "code",
        "",
        1,
    ),
    "french": (
        "soft_prompt",
        "Answers in French and translates English text into French.",
        "french,français,translate",
        "Translate this sentence into French.",
        "translation",
        "language:fr",
        "",
        0,
    ),
    "german": (
        "soft_prompt",
        "Answers in German and translates English text into German.",
        "german,deutsch",
        "Translate this sentence into German.",
        "",
        "language:de",
        "",
        0,
    ),
    "summarizer": (
        "lora",
        "Summarizes long documents into a short paragraph.",
        "summary,summarize",
        "Summarize this article in three sentences.",
        "summarization",
        "",
        "",
        2,
    ),
    "bullet-points": (
        "lora",
        "Turns documents into bullet-point summaries of their key points.",
        "bullet points,key points",
        "List the key points of this report as bullets.",
        "summarization",
        "",
        "",
        1,
    ),
    "tldr": (
        "lora",
        "Writes one-line TL;DR summaries.",
        "tldr,one line",
        "Give me a TL;DR of this thread.",
        "summarization",
        "",
        "",
        0,
    ),
    "poet": (
        "ia3",
        "Writes poems, haiku and song lyrics.",
        "poem,haiku,lyrics",
        "Write a haiku about autumn leaves.",
        "creative_writing",
        "",
        "",
        0,
    ),
    "math-solver": (
        "ia3",
        "Solves arithmetic and algebra problems step by step.",
        "math,algebra,equation",
        "Solve the equation 3x + 5 = 20 for x.",
        "",
        "math",
        "",
        0,
    ),
    "regex-builder": (
        "lora",
        "Builds regular expressions that match the patterns described.",
        "regex,regular expression,pattern",
        "Build a regular expression that matches email addresses.",
        "",
        "",
        "",
        0,
    ),
}
ENGINE_B = "engine-b"


@pytest.fixture(scope="module")
def packages(tiny_llama, tmp_path_factory) -> tuple[Publisher, dict[str, Path]]:
    root = tmp_path_factory.mktemp("experts")
    publisher = Publisher.create(root)
    packages = {}
    for seed, (
        name,
        (kind, description, keywords, example, tasks, caps, incompatible, priority),
    ) in enumerate(EXPERTS.items()):
        peft_dir = WRITERS[kind](tiny_llama, root / "peft" / name, seed=seed)
        examples = root / f"{name}.examples.json"
        examples.write_text(json.dumps([example]))
        packages[name] = publisher.pack(
            peft_dir,
            tiny_llama,
            root / f"{name}.expert",
            name,
            "1.0.0",
            "--keywords",
            keywords,
            "--task-types",
            tasks,
            "--capabilities",
            caps,
            "--incompatible-with",
            incompatible,
            "--priority",
            str(priority),
            "--examples",
            str(examples),
            "--description",  # the last --description wins over Publisher.pack's generic one
            description,
        )
    return publisher, packages


def lora_footprint(tiny_llama: Path, publisher: Publisher, package: Path) -> int:
    """What one of the test LoRAs occupies on an engine's device tier (they all have one shape)."""
    manager = ExpertManager(
        ModelConfig.from_dir(tiny_llama),
        AdapterConfig(trusted_keys_dir=str(publisher.trusted)),
        torch.device("cpu"),
    )
    manager.load(package)
    return manager.experts()[0].footprint_bytes


@pytest.fixture(scope="module")
def stack(tiny_llama, packages, tmp_path_factory) -> LocalStack:
    """Two engines whose expert budget holds two of the test LoRAs but not three."""
    publisher, files = packages
    root = tmp_path_factory.mktemp("expert-stack")
    budget = int(2.5 * lora_footprint(tiny_llama, publisher, files["summarizer"]))
    env = stack_env(
        tiny_llama,
        EXPERT_MAX_MODEL_LEN="1024",
        EXPERT_KV_NUM_BLOCKS="160",
        EXPERT_MAX_NUM_SEQS="4",
        EXPERT_STORE=str(root / "store"),
        EXPERT_TRUSTED_KEYS=str(publisher.trusted),
        EXPERT_ADAPTER_DEVICE_BYTES=str(budget),
        EXPERT_ROUTER_FEEDBACK_ALPHA="0.2",
    )
    stack = LocalStack.on_free_ports(root, env=env)
    stack.start()
    try:
        stack.start_engine(ENGINE_B)
        for name, path in files.items():
            code = expertctl(
                [
                    "expert",
                    "install",
                    str(path),
                    "--store",
                    str(root / "store"),
                    "--trusted",
                    str(publisher.trusted),
                    "--model",
                    str(tiny_llama),
                    "--router",
                    stack.target("router"),
                ]
            )
            assert code == 0, f"installing {name} failed"
        _wait_for_engines(stack, 2)
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.stop()


def _wait_for_engines(stack: LocalStack, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(_engines(stack)) < count:
        assert time.monotonic() < deadline, "the engines did not register"
        time.sleep(0.1)


def _engines(stack: LocalStack):
    with grpc.insecure_channel(stack.target("preparation")) as channel:
        stub = preparation_pb2_grpc.PreparationServiceStub(channel)
        return list(stub.ListEngines(preparation_pb2.ListEnginesRequest(), timeout=10).engines)


def _registered(stack: LocalStack, name: str) -> router_pb2.RegisteredExpert:
    with grpc.insecure_channel(stack.target("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        return stub.GetRegisteredExpert(router_pb2.GetRegisteredExpertRequest(name=name), timeout=10).expert


def _infer(client: ExpertClient, prompt: str, **fields):
    result = client.infer(prompt=prompt, temperature=0.0, max_tokens=4, **fields)
    assert result.status == "completed", f"{result.status}: {result.error_code} {result.error}"
    return result


def _first_candidate(trace: str) -> str:
    return re.search(r"^candidate (\S+)@", trace, re.MULTILINE).group(1)


def _placed_on(trace: str) -> str:
    return re.search(r"^preparation: engine (\S+) ", trace, re.MULTILINE).group(1)


# -- placement, before any job ran ---------------------------------------------------------------


def test_experts_an_engine_holds_draw_their_jobs_to_it(client, stack, packages):
    """Load two experts on the engine the fleet's tie-break does not favour (as an operator would,
    with LoadExpert): its heartbeat tells preparation, and the job goes there with no transfer."""
    _, files = packages
    engines = _engines(stack)
    favoured = _placed_on(_infer(client, "Say hello.").reasoning_trace)
    other = next(e for e in engines if e.engine_id != favoured)
    with grpc.insecure_channel(other.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for name in ("regex-builder", "math-solver"):
            data = files[name].read_bytes()
            parts = [engine_pb2.LoadExpertRequest(size=len(data)), engine_pb2.LoadExpertRequest(chunk=data)]
            stub.LoadExpert(iter(parts), timeout=30)
    time.sleep(1.5)  # three heartbeats
    result = _infer(client, "Say hello.", force_experts=["regex-builder", "math-solver"], max_experts=2)
    assert _placed_on(result.reasoning_trace) == other.engine_id
    assert "preparation: staged" not in result.reasoning_trace
    assert set(result.experts_used) == {"regex-builder", "math-solver"}
    held = {
        e.name for e in next(e for e in _engines(stack) if e.engine_id == other.engine_id).experts.experts
    }
    assert {"regex-builder", "math-solver"} <= held


# -- selection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expert"),
    [
        ('Parse this JSON and extract the email field: {"email": "a@b.c"}', "json-parser"),
        ("Write a SQL query that lists customers with more than three orders.", "sql-writer"),
        ("Write a Python function that returns the largest of three numbers.", "python-coder"),
        ("Traduisez cette phrase en anglais, s'il vous plaît : le chat dort sur le canapé.", "french"),
        ("Write a haiku about the first snow of winter.", "poet"),
        ("Solve the equation 2x + 7 = 19 for x, step by step.", "math-solver"),
    ],
)
def test_a_prompt_selects_the_expert_for_its_skill_with_the_seeds_score(client, prompt, expert):
    result = _infer(client, prompt)
    assert result.status == "completed", result.error
    assert _first_candidate(result.reasoning_trace) == expert
    assert expert in result.experts_used
    line = next(
        line for line in result.reasoning_trace.splitlines() if line.startswith(f"candidate {expert}@")
    )
    parts = re.search(
        r"score ([\d.]+) = 0\.50 x similarity ([\d.]+) \+ 0\.30 x success ([\d.]+) "
        r"\+ 0\.20 x \(1 - ([\d.]+) MB",
        line,
    )
    total, similarity, success, size = map(float, parts.groups())
    assert total == pytest.approx(0.5 * similarity + 0.3 * success + 0.2 * (1 - size / 100), abs=2e-3)


def test_experts_used_is_what_the_engine_applied(client):
    result = _infer(client, "Write a SQL query that lists customers with more than three orders.")
    assert result.experts_used == tuple(e.name for e in result.experts)
    assert {e.adapter_type for e in result.experts} <= {"lora", "ia3", "soft_prompt"}
    assert all(e.version == "1.0.0" and e.weight == 1.0 for e in result.experts)


def test_an_unrelated_prompt_falls_back_to_the_base_model(client):
    result = _infer(client, "What colour are flamingos?")
    assert result.experts_used == () and "fallback" in result.reasoning_trace


def test_force_exclude_and_max_experts(client):
    prompt = 'Parse this JSON and extract the email field: {"email": "a@b.c"}'
    forced = _infer(client, prompt, force_experts=["german"])
    assert "german" in forced.experts_used
    excluded = _infer(client, prompt, exclude_experts=["json-parser"])
    assert (
        "json-parser" not in excluded.experts_used and "excluded by the request" in excluded.reasoning_trace
    )
    one = _infer(client, prompt, max_experts=1)
    assert len(one.experts_used) == 1
    with pytest.raises(InvalidRequest) as unknown:
        _infer(client, prompt, force_experts=["no-such-expert"])
    assert unknown.value.field_violations[0][0] == "request.force_experts[0]"


def test_incompatible_experts_are_never_used_together(client):
    result = _infer(client, "Write a Python script that runs a SQL query against the orders database.")
    assert not {"sql-writer", "python-coder"} <= set(result.experts_used)
    assert "incompatible with" in result.reasoning_trace
    with pytest.raises(InvalidRequest) as both:
        _infer(client, "Hello.", force_experts=["sql-writer", "python-coder"])
    assert both.value.field_violations[0][0] == "request.force_experts[1]"


# -- placement ----------------------------------------------------------------------------------------


def test_a_second_job_with_the_same_experts_goes_where_they_are_hot_and_sends_nothing(client, stack):
    experts = ["poet", "german"]
    first = _infer(client, "Tell me about the sea.", force_experts=experts, max_experts=2)
    engine = _placed_on(first.reasoning_trace)
    assert set(first.experts_used) == set(experts)
    second = _infer(client, "Tell me about the mountains.", force_experts=experts, max_experts=2)
    assert _placed_on(second.reasoning_trace) == engine
    assert "preparation: staged" not in second.reasoning_trace
    assert f"preparation: engine {engine} (2 of the plan's experts hot" in second.reasoning_trace
    assert set(second.experts_used) == set(experts)


def test_an_over_budget_plan_is_degraded_and_says_so(client):
    """Three summarization LoRAs are chosen (the prompt names each one's kind, so none falls under the
    companion ratio); the engines' expert budget holds two."""
    prompt = "Summarize the key points of this report as a one line TL;DR: sales rose and costs fell."
    result = _infer(client, prompt)
    chosen = {"summarizer", "bullet-points", "tldr"}
    order = next(line for line in result.reasoning_trace.splitlines() if line.startswith("composition order"))
    assert chosen <= set(order.split(": ", 1)[1].split(", "))  # the router's plan named all three
    assert result.status == "completed"
    assert len(result.dropped_experts) == 1 and set(result.dropped_experts) <= chosen
    # experts_used is the engine's record, not the plan: the dropped expert is not in it
    assert set(result.experts_used) & chosen == chosen - set(result.dropped_experts)
    assert re.search(
        r"^preparation: dropped \S+ \(score [\d.]+\): the plan's experts need", result.reasoning_trace, re.M
    )


def test_forced_experts_that_cannot_fit_are_refused_not_dropped(client):
    with pytest.raises(FailedPrecondition) as refused:
        _infer(client, "Hello.", force_experts=["summarizer", "bullet-points", "tldr"], max_experts=3)
    assert "forced experts" in str(refused.value)


# -- the registry and feedback ------------------------------------------------------------------------


def test_a_router_restart_keeps_the_registry(client, stack):
    before = _registered(stack, "sql-writer")
    stack.stop_service("router")
    stack.start_service("router")
    stack.wait_serving("router")
    after = _registered(stack, "sql-writer")
    assert (after.version, after.content_hash, after.uses) == (
        before.version,
        before.content_hash,
        before.uses,
    )
    result = _infer(client, "Write a SQL query that lists customers with more than three orders.")
    assert _first_candidate(result.reasoning_trace) == "sql-writer"


def test_failed_validations_lower_an_experts_score_until_a_competitor_overtakes_it(client, stack):
    """Every JSON answer of the tiny model fails validation; with one expert per job, only the leader
    is used and learns it, until the other JSON expert scores higher."""
    prompt = 'Parse this JSON and extract the id field: {"id": 7}'
    initial = {name: _registered(stack, name) for name in ("json-parser", "json-validator")}
    leaders = []
    for _ in range(20):
        result = _infer(client, prompt, max_experts=1)
        assert result.validation is not None and not result.validation.valid
        leaders.append(_first_candidate(result.reasoning_trace))
        assert result.experts_used == (leaders[-1],)
        if leaders[-1] != leaders[0]:
            break
        time.sleep(0.2)  # the router reads the feedback stream as it comes
    else:
        pytest.fail(f"{leaders[0]} stayed first after 20 failed validations")
    assert set(leaders) == set(initial)
    dropped = _registered(stack, leaders[0])
    assert dropped.success_rate < initial[leaders[0]].success_rate
    assert dropped.uses >= initial[leaders[0]].uses + len(leaders) - 1
