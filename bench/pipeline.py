"""The pipeline's own cost on the default model, measured in one run: per-stage latency at 1 and 16
concurrent clients against the stage budgets (docs/design.md#stage-budgets), and the end-to-end
overhead against calling `LLMEngine` directly with the same final input.

The same prompts run twice: first on an in-process `LLMEngine` (the peer), then through the whole
stack (a redis-server and the five services as processes, libs.stack) with `ExpertClient.infer`.
Greedy decoding makes both produce the same tokens, so the difference in wall time per request is
what reception, the router, preparation, postproc, Redis and the gRPC hops add.

The stages are the job's InferenceMetrics: reception is the reception stage (validation,
normalization, the job id); the enqueue that follows counts in the queue wait; router, preparation
and postproc are measured inside those services. A stage passes when its p99 is within the budget.

    python bench/pipeline.py --model data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# The stage budgets (ms, docs/design.md#stage-budgets): a stage passes when its p50 and p99 are at
# most the upper bound.
BUDGETS_MS = {
    "reception": (0.0, 1.0),
    "router": (10.0, 50.0),
    "preparation": (1.0, 200.0),
    "postproc": (1.0, 10.0),
}
OVERHEAD_TARGET_MS = 15.0  # p50 at 1 client
MAX_MODEL_LEN = 1024

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is two plus two?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a cat.",
    "What is the boiling point of water?",
    "List two fruits that are red.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet?",
    "Describe a tree in five words.",
    "What day comes after Monday?",
    "Tell me a fact about the moon.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Direct:
    """The peer: an in-process LLMEngine with the engine service's settings."""

    def __init__(self, model: str, max_num_seqs: int, max_tokens: int) -> None:
        from libs.engine import LLMEngine, SamplingParams

        self.engine = LLMEngine.from_pretrained(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=1.0)
        self.wave(["Hello"])  # warm-up

    def wave(self, prompts: list[str]) -> list[float]:
        """Seconds per request for `prompts` run together (each request's latency is the wave's)."""
        began = time.perf_counter()
        self.engine.chat([[{"role": "user", "content": p}] for p in prompts], self.params)
        return [time.perf_counter() - began] * len(prompts)


class Through:
    """The same requests through reception, one SDK call per client thread."""

    def __init__(self, target: str, max_tokens: int, clients: int) -> None:
        from expert_system import ExpertClient

        self.client = ExpertClient(target)
        self.max_tokens = max_tokens
        self.pool = ThreadPoolExecutor(clients)
        self.one("Hello")  # warm-up: channels, the router's first plan, the engine's first request

    def one(self, prompt: str) -> tuple:
        began = time.perf_counter()
        result = self.client.infer(
            prompt=prompt, temperature=0.0, max_tokens=self.max_tokens, repetition_penalty=1.0
        )
        if result.status != "completed":
            raise RuntimeError(f"job {result.job_id} ended {result.status}: {result.error}")
        return time.perf_counter() - began, result

    def wave(self, prompts: list[str]) -> list[tuple]:
        return list(self.pool.map(self.one, prompts))

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def measure(direct: Direct, through: Through, prompts: list[str], clients: int) -> tuple[list, list]:
    """Waves of `clients` requests, alternating between the peer and the pipeline so that the
    machine's drift (these machines are noisy) affects both alike. Only one side runs at a time:
    the other is idle."""
    peer, ours = [], []
    for start in range(0, len(prompts), clients):
        wave = prompts[start : start + clients]
        peer += direct.wave(wave)
        ours += through.wave(wave)
    return peer, ours


def stage_ms(result) -> dict[str, float]:
    m = result.metrics
    return {
        "reception": m.reception_latency_ms,
        "router": m.router_latency_ms,
        "preparation": m.expert_load_latency_ms,
        "postproc": m.postproc_latency_ms,
        "queue": m.queue_latency_ms,
        "inference": m.inference_latency_ms,
    }


def report(clients: int, direct: list[float], through: list[tuple]) -> bool:
    stages: dict[str, list[float]] = {}
    for _, result in through:
        for name, value in stage_ms(result).items():
            stages.setdefault(name, []).append(value)
    print(f"\n{clients} client{'s' if clients > 1 else ''}, {len(through)} requests")
    print(f"{'stage':<14}{'p50 ms':>10}{'p99 ms':>10}   budget")
    ok = True
    for name, values in stages.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        line = f"{name:<14}{p50:>10.2f}{p99:>10.2f}"
        if name in BUDGETS_MS:
            low, high = BUDGETS_MS[name]
            within = p99 <= high
            ok &= within
            line += f"   {low:g}-{high:g} ms   {'PASS' if within else 'over'}"
        print(line)
    walls = [wall * 1000 for wall, _ in through]
    peers = [d * 1000 for d in direct]
    overheads = [w - d for w, d in zip(walls, peers, strict=True)]
    print(
        f"{'end to end':<14}{percentile(walls, 50):>10.1f}{percentile(walls, 99):>10.1f}"
        f"   LLMEngine directly: p50 {percentile(peers, 50):.1f} ms, p99 {percentile(peers, 99):.1f} ms"
    )
    p50 = statistics.median(overheads)
    line = f"{'overhead':<14}{p50:>10.1f}{percentile(overheads, 99):>10.1f}"
    if clients == 1:
        within = p50 <= OVERHEAD_TARGET_MS
        ok &= within
        line += f"   target p50 <= {OVERHEAD_TARGET_MS:g} ms   {'PASS' if within else 'over'}"
    print(line)
    return ok


def stack_env(model: str, threads: int, max_num_seqs: int) -> dict[str, str]:
    return {
        "EXPERT_MODEL_PATH": str(Path(model).resolve()),
        "EXPERT_NUM_THREADS": str(threads),
        "EXPERT_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "EXPERT_MAX_NUM_SEQS": str(max_num_seqs),
        "EXPERT_KV_CACHE_BYTES": str(1 << 30),
        "EXPERT_LOG_LEVEL": "warning",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from libs.stack import LocalStack

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    slots = max(args.clients)
    direct = Direct(args.model, slots, args.max_tokens)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as logs:
        stack = LocalStack.on_free_ports(Path(logs), env=stack_env(args.model, args.threads, slots))
        stack.start(timeout=600)
        try:
            for clients in args.clients:
                through = Through(stack.target("reception"), args.max_tokens, clients)
                try:
                    figures[clients] = measure(direct, through, prompts, clients)
                finally:
                    through.close()
        finally:
            stack.stop()
    print(
        f"\npipeline overhead, {args.model}, fp32, CPU, {args.threads} engine threads: greedy, "
        f"{args.max_tokens} new tokens, chat template; peer: LLMEngine in-process on the same input"
    )
    ok = all([report(c, *figures[c]) for c in args.clients])
    print(f"\n{'all within budget' if ok else 'some figures over budget'}")


if __name__ == "__main__":
    main()
