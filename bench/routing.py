"""Routing and staging on the default model, measured in one run.

Router: the latency of `Plan` over gRPC with 10, 100 and 1,000 registered experts, p50 and p99,
against the target (p50 <= 25 ms at 1,000 experts, inside the router's 10-50 ms stage budget). The
experts are synthetic manifests (40 domains x 25 skills, each with a description, keywords and an
example prompt) registered through `RegisterExpert`, so the router embeds them itself. The peer is
the floor of any embedding router: one all-MiniLM-L6-v2 encode of the prompt in this process.

Staging: preparation's latency (the job's expert_load_latency_ms) for a job whose expert no engine
holds yet (cold: the package is read from the store and streamed with `LoadExpert`) and for a job
whose expert the engine holds already (hot: nothing moves). The peer is the engine's own load of
the same package from a local file (`ExpertManager.load`, signature check included).

Both run against one local stack (redis-server and the five services as processes, tools.stack).

    python bench/routing.py --model data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from adapters import make_adapters, make_packages
from pipeline import percentile, stack_env

PLAN_TARGET_P50_MS = 25.0  # at 1,000 experts
ROUTER_BUDGET_MS = (10.0, 50.0)  # the router's stage budget (docs/design.md#stage-budgets)
SIZES = (10, 100, 1000)

DOMAINS = [
    "accounting", "astronomy", "aviation", "biology", "chemistry", "chess", "cooking", "cryptography",
    "dentistry", "ecology", "economics", "electronics", "fashion", "film", "gardening", "geology",
    "history", "insurance", "journalism", "law", "linguistics", "logistics", "marketing", "medicine",
    "meteorology", "music", "nutrition", "oceanography", "philosophy", "photography", "physics",
    "psychology", "real estate", "robotics", "sports", "taxes", "telecom", "theatre", "tourism",
    "veterinary care",
]  # fmt: skip
SKILLS = [
    ("summarizes", "summaries", "Summarize this {d} report in three sentences."),
    ("translates into French", "french translation", "Translate this {d} note into French."),
    ("answers questions about", "questions, answers", "What is the most common mistake in {d}?"),
    ("writes SQL over databases of", "sql, queries", "Write a SQL query listing the {d} records of 2024."),
    ("writes Python code for", "python, scripts", "Write a Python function for a {d} calculation."),
    ("extracts JSON fields from", "json, extraction", "Extract the fields of this {d} JSON record."),
    ("classifies documents of", "classification", "Which category does this {d} document belong to?"),
    ("explains to beginners", "tutorial, beginner", "Explain the basics of {d} to a beginner."),
    ("writes emails about", "email, letters", "Write a polite email about a {d} appointment."),
    ("checks facts in", "fact checking", "Is this claim about {d} true?"),
    ("writes poems about", "poetry, verse", "Write a short poem about {d}."),
    ("drafts contracts for", "contracts, clauses", "Draft a contract clause for a {d} service."),
    ("builds regular expressions for", "regex, patterns", "Build a regex for {d} reference numbers."),
    ("plans projects in", "planning, schedules", "Plan a three-month {d} project."),
    ("reviews writing on", "proofreading, style", "Proofread this paragraph on {d}."),
    ("does arithmetic for", "math, arithmetic", "Compute the yearly total for this {d} budget."),
    ("writes product descriptions for", "copywriting", "Describe this {d} product in 50 words."),
    ("answers in German about", "german, deutsch", "Antworte auf Deutsch: was ist {d}?"),
    ("lists key points of", "bullet points", "List the key points of this {d} article."),
    ("compares options in", "comparison, pros and cons", "Compare two approaches in {d}."),
    ("writes tests for software in", "unit tests, pytest", "Write pytest tests for a {d} module."),
    ("designs schemas for", "json schema, data model", "Design a JSON schema for {d} data."),
    ("writes interview questions on", "interviews, hiring", "Give five interview questions on {d}."),
    ("simplifies jargon of", "plain language", "Rewrite this {d} text in plain language."),
    ("writes tweets about", "social media", "Write a tweet announcing a {d} event."),
]
PROMPTS = [
    "Summarize this astronomy report about the new comet in three sentences.",
    "Write a SQL query that lists every insurance claim filed in March.",
    'Extract the name and price fields from this JSON: {"name": "tent", "price": 120}',
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Translate 'the harvest was late this year' into French.",
    "What is the capital of Australia?",
    "Write a short poem about the sea at night.",
    "Explain how compound interest works to a beginner.",
]


def synthetic_manifests(count: int, lora_manifest) -> list:
    """`count` (at most 1,000) LoRA manifests with distinct skills, shaped like the real bench LoRA."""
    from dataclasses import replace

    manifests = []
    for i in range(count):
        domain = DOMAINS[i % len(DOMAINS)]
        verb, keywords, example = SKILLS[(i // len(DOMAINS)) % len(SKILLS)]
        manifests.append(
            replace(
                lora_manifest,
                name=f"{domain.replace(' ', '-')}-{i:04d}",
                description=f"An expert that {verb} {domain}.",
                keywords=(domain, *[k.strip() for k in keywords.split(",")]),
                examples=(example.format(d=domain),),
            )
        )
    return manifests


def register(router_target: str, manifests: list, weight_bytes: int) -> float:
    """Register `manifests` with the router; returns the seconds it took."""
    import grpc

    from libs.gen.expert.v1 import router_pb2, router_pb2_grpc

    began = time.perf_counter()
    with grpc.insecure_channel(router_target) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for m in manifests:
            stub.RegisterExpert(
                router_pb2.RegisterExpertRequest(
                    manifest_json=m.to_json_bytes(),
                    content_hash=hashlib.sha256(m.name.encode()).hexdigest(),
                    weight_bytes=weight_bytes,
                ),
                timeout=30,
            )
    return time.perf_counter() - began


def plan_latencies(router_target: str, calls: int) -> tuple[list[float], list[int]]:
    """Milliseconds per Plan call (client side, sequential), and the experts each plan chose."""
    import grpc

    from libs.gen.expert.v1 import common_pb2, router_pb2, router_pb2_grpc

    latencies, chosen = [], []
    with grpc.insecure_channel(router_target) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for i in range(calls + 5):
            request = router_pb2.PlanRequest(
                job_id=f"bench-{i}", request=common_pb2.InferenceRequest(prompt=PROMPTS[i % len(PROMPTS)])
            )
            began = time.perf_counter()
            plan = stub.Plan(request, timeout=30).plan
            if i >= 5:  # the first calls warm the channel and the router's caches
                latencies.append((time.perf_counter() - began) * 1000)
                chosen.append(len(plan.experts))
    return latencies, chosen


def encode_floor(calls: int) -> list[float]:
    """The peer: one MiniLM encode of a prompt, in this process, milliseconds."""
    from services.router.embedding import SentenceEncoder

    encoder = SentenceEncoder.from_package()
    encoder.encode(["warm up"])
    out = []
    for i in range(calls):
        began = time.perf_counter()
        encoder.encode([PROMPTS[i % len(PROMPTS)]])
        out.append((time.perf_counter() - began) * 1000)
    return out


def install(stack, packages: list[Path], store: Path, trusted: Path, model: str) -> None:
    from tools.expertctl.main import main as expertctl

    for path in packages:
        code = expertctl(
            [
                *("expert", "install", str(path), "--store", str(store), "--trusted", str(trusted)),
                *("--model", model, "--router", stack.target("router")),
            ]
        )
        if code != 0:
            raise RuntimeError(f"installing {path.name} failed")


def staging(stack, names: list[str]) -> tuple[list[float], list[float]]:
    """Preparation milliseconds for each expert's first job (cold) and second job (hot)."""
    from expert_system import ExpertClient

    cold, hot = [], []
    with ExpertClient(stack.target("reception")) as client:
        client.infer(prompt="Hello", max_tokens=1, timeout=120)  # warm-up without experts
        for name in names:
            for times, moved in ((cold, True), (hot, False)):
                result = client.infer(
                    prompt="Say hello.", force_experts=[name], max_experts=1, max_tokens=1, timeout=120
                )
                if result.status != "completed" or list(result.experts_used) != [name]:
                    raise RuntimeError(f"job {result.job_id} ended {result.status}: {result.error}")
                staged = f"preparation: staged {name}@" in result.reasoning_trace
                if staged != moved:
                    raise RuntimeError(f"expected staged={moved} for {name}:\n{result.reasoning_trace}")
                times.append(result.metrics.expert_load_latency_ms)
    return cold, hot


def local_loads(model: str, packages: list[Path], trusted: Path) -> list[float]:
    """The peer: milliseconds for the engine's expert manager to load each package from a file."""
    from libs.engine.adapters.manager import ExpertManager
    from libs.engine.config import AdapterConfig
    from libs.engine.models.config import ModelConfig

    manager = ExpertManager(
        ModelConfig.from_dir(model), AdapterConfig(trusted_keys_dir=str(trusted)), torch.device("cpu")
    )
    out = []
    for path in packages:
        began = time.perf_counter()
        manager.load(path)
        out.append((time.perf_counter() - began) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200, help="Plan calls per registry size")
    parser.add_argument("--experts", type=int, default=6, help="real packages staged cold then hot")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from libs.experts.store import ExpertStore
    from tools.stack import LocalStack

    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        root = Path(tmp)
        dirs = make_adapters(args.model, root / "peft", args.experts, args.rank)
        packages, trusted = make_packages(args.model, dirs, root)
        store = root / "store"
        env = stack_env(args.model, args.threads, 4) | {
            "EXPERT_STORE": str(store),
            "EXPERT_TRUSTED_KEYS": str(trusted),
        }
        stack = LocalStack.on_free_ports(root / "stack", env=env)
        stack.start(timeout=600)
        try:
            install(stack, packages, store, trusted, args.model)
            names = [f"bench-lora-{i}" for i in range(len(packages))]
            cold, hot = staging(stack, names)
            local = local_loads(args.model, packages, trusted)

            # The installed packages count among the registered experts; synthetic ones fill up.
            stored = ExpertStore(store).get(names[0])
            weight_bytes = stored.weight_bytes
            synthetic = synthetic_manifests(max(SIZES) - len(names), stored.manifest)
            plans: dict[int, tuple[list[float], list[int], float]] = {}
            done = 0
            for size in SIZES:
                batch = synthetic[done : size - len(names)]
                seconds = register(stack.target("router"), batch, weight_bytes)
                done += len(batch)
                latencies, chosen = plan_latencies(stack.target("router"), args.calls)
                plans[size] = (latencies, chosen, seconds)
            floor = encode_floor(args.calls)
        finally:
            stack.stop()

    print(
        f"\nrouting and staging, {args.model}, CPU, {args.threads} threads; "
        f"{args.calls} Plan calls per size over gRPC, {len(PROMPTS)} prompts in turn"
    )
    print(f"{'registered experts':<20}{'p50 ms':>9}{'p99 ms':>9}{'chosen/plan':>13}{'register s':>12}")
    for size, (latencies, chosen, seconds) in plans.items():
        print(
            f"{size:<20}{percentile(latencies, 50):>9.2f}{percentile(latencies, 99):>9.2f}"
            f"{statistics.mean(chosen):>13.1f}{seconds:>12.1f}"
        )
    floor_p50 = percentile(floor, 50)
    p50_1000, p99_1000 = percentile(plans[1000][0], 50), percentile(plans[1000][0], 99)
    print(f"{'one MiniLM encode':<20}{floor_p50:>9.2f}{percentile(floor, 99):>9.2f}   (the peer, in process)")
    print(
        f"Plan p50 at 1,000 / encode p50     {p50_1000 / floor_p50:>6.2f}x\n"
        f"Plan p50 at 1,000 / target         {p50_1000 / PLAN_TARGET_P50_MS:>6.2f}x   target <= 1.00x "
        f"(p50 <= {PLAN_TARGET_P50_MS:g} ms)   {'PASS' if p50_1000 <= PLAN_TARGET_P50_MS else 'over'}\n"
        f"Plan p99 at 1,000 in seed budget   {p99_1000:>6.2f} ms   <= {ROUTER_BUDGET_MS[1]:g} ms   "
        f"{'PASS' if p99_1000 <= ROUTER_BUDGET_MS[1] else 'over'}"
    )
    mib = weight_bytes / 2**20
    print(
        f"\nstaging one rank-{args.rank} LoRA ({mib:.1f} MiB of weights): preparation ms per job, "
        f"{len(cold)} experts"
    )
    print(f"{'':<34}{'p50 ms':>9}{'max ms':>9}")
    for label, values in (
        ("cold (streamed with LoadExpert)", cold),
        ("hot (held by the engine)", hot),
        ("peer: engine loads from a file", local),
    ):
        print(f"{label:<34}{percentile(values, 50):>9.2f}{max(values):>9.2f}")
    print(
        f"cold / hot                        {percentile(cold, 50) / percentile(hot, 50):>6.2f}x\n"
        f"cold / local load                 {percentile(cold, 50) / percentile(local, 50):>6.2f}x"
    )


if __name__ == "__main__":
    main()
