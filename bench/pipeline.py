"""The pipeline's own cost on the default model, measured in one run: per-stage latency against the
stage budgets (docs/design.md#stage-budgets), the end-to-end overhead, tokens/s and time to first
token, each against calling `LLMEngine` directly with the same final input.

Each wave of `clients` concurrent requests runs three times: on an in-process `LLMEngine` (the
peer, all of the wave submitted at once), then through the whole stack (a redis-server and the five
services as processes, tools.stack) with one `ExpertClient.infer` call per client, then the same
streamed, one `infer_stream` call per client. Greedy decoding makes all three produce the same
tokens, so the differences are what reception, the router, preparation, postproc, Redis and the
gRPC hops add, and what streaming every token to the client adds on top.

The stages are the job's InferenceMetrics: reception is the reception stage (validation,
normalization, the job id); the enqueue that follows counts in the queue wait; router, preparation
and postproc are measured inside those services. A stage passes when its p99 is within the budget.
Tokens/s is the waves' generated tokens over their wall time; the target is 0.95x the peer at 32
clients, for `infer` calls. Time to first token is, streamed through the stack, from the call to its
first text chunk; in process, from the request's arrival to its first token. At 1 client, a lone
streamed request's time to first token is split hop by hop (reception, queue, router, preparation,
the engine's own TTFT, the rest), and what the pipeline adds to the engine's TTFT has a target of
at most 25 ms at p50.

Last, the HTTP front against gRPC: the same one-token job on a cached prompt, `ExpertClient.infer`
against POST /v1/chat/completions (httpx), half and half in each wave of 1 or 16 concurrent calls;
the target is that HTTP adds at most 2 ms at p50.

    python bench/pipeline.py --model data/models/SmolLM2-135M-Instruct --clients 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
TTFT_ADDED_TARGET_MS = 25.0  # streamed TTFT p50 over the engine's own, at 1 client
THROUGHPUT_TARGET = 0.95  # of the peer's tokens/s, at 32 clients
MAX_MODEL_LEN = 1024

QUESTIONS = [
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
# After the question, so that prompts share no prefix beyond the chat template's: with the
# template's system turn, each prompt is about 130 tokens.
NOTE = (
    "\n\nAnswer in a few sentences. Some background that may or may not help: the reader is a "
    "student preparing for a general knowledge quiz at school next week. They like short, clear "
    "answers with one concrete example, and they prefer plain words to technical terms. If the "
    "question has a single right answer, give it first and then explain it briefly; if it asks for "
    "ideas, give a few and say which one you like best."
)


def prompts(count: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] + NOTE for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Wave:
    """One wave's figures: its wall time, and per request the latency, TTFT and tokens."""

    wall_s: float
    latency_s: list[float]
    ttft_s: list[float]
    tokens: list[int]
    prompt_tokens: list[int]
    results: list  # the stack's InferenceResults (empty for the peer)


class Direct:
    """The peer: an in-process LLMEngine with the engine service's settings."""

    def __init__(self, model: str, max_num_seqs: int, max_tokens: int) -> None:
        from libs.engine import LLMEngine, SamplingParams

        self.engine = LLMEngine.from_pretrained(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=1.0)
        self.wave(["Hello"])  # warm-up

    def wave(self, batch: list[str]) -> Wave:
        began = time.perf_counter()
        outs = self.engine.chat([[{"role": "user", "content": p}] for p in batch], self.params)
        wall = time.perf_counter() - began
        return Wave(
            wall_s=wall,
            latency_s=[o.metrics.e2e_latency for o in outs],
            ttft_s=[o.metrics.ttft for o in outs],
            tokens=[len(o.token_ids) for o in outs],
            prompt_tokens=[len(o.prompt_token_ids) for o in outs],
            results=[],
        )


class Through:
    """The same requests through reception, one SDK call per client thread: `infer`, or
    `infer_stream` when `stream`."""

    def __init__(self, target: str, max_tokens: int, clients: int) -> None:
        from expert_system import ExpertClient

        self.client = ExpertClient(target)
        self.max_tokens = max_tokens
        self.pool = ThreadPoolExecutor(clients)
        self.one("Hello", stream=True)  # warm-up: channels, the router's first plan, the engine

    def one(self, prompt: str, stream: bool) -> tuple[float, float, object]:
        began = time.perf_counter()
        options = {"temperature": 0.0, "max_tokens": self.max_tokens, "repetition_penalty": 1.0}
        if not stream:
            result = self.client.infer(prompt=prompt, **options)
            first = 0.0  # not seen by the client
        else:
            first = None
            call = self.client.infer_stream(prompt=prompt, **options)
            for chunk in call:
                if first is None and chunk.text:
                    first = time.perf_counter() - began
            result = call.result
        if result is None or result.status != "completed":
            raise RuntimeError(f"job ended {result and result.status}: {result and result.error}")
        return time.perf_counter() - began, first or 0.0, result

    def wave(self, batch: list[str], stream: bool) -> Wave:
        began = time.perf_counter()
        runs = list(self.pool.map(lambda prompt: self.one(prompt, stream), batch))
        wall = time.perf_counter() - began
        return Wave(
            wall_s=wall,
            latency_s=[latency for latency, _, _ in runs],
            ttft_s=[ttft for _, ttft, _ in runs],
            tokens=[r.tokens_generated for _, _, r in runs],
            prompt_tokens=[r.metrics.input_tokens for _, _, r in runs],
            results=[r for _, _, r in runs],
        )

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def measure(direct: Direct, through: Through, batch: list[str], clients: int) -> tuple[list, list, list]:
    """Waves of `clients` requests, alternating between the peer, `infer` and `infer_stream` so that
    the machine's drift (these machines are noisy) affects all alike. Only one runs at a time."""
    peer, ours, streamed = [], [], []
    for start in range(0, len(batch), clients):
        wave = batch[start : start + clients]
        peer.append(direct.wave(tagged(wave, f"a{start}")))
        ours.append(through.wave(tagged(wave, f"b{start}"), stream=False))
        streamed.append(through.wave(tagged(wave, f"c{start}"), stream=True))
    return peer, ours, streamed


def tagged(wave: list[str], run: str) -> list[str]:
    """The wave's prompts, each made new to the engines' prefix caches: `run` and the request's
    place lead the prompt, so no run reuses another's cached prompt blocks (the chat template's
    system turn, the same for all, is shared alike)."""
    return [f"({run}-{i}) {prompt}" for i, prompt in enumerate(wave)]


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


def flat(waves: list[Wave], name: str) -> list:
    return [value for wave in waves for value in getattr(wave, name)]


def tokens_per_second(waves: list[Wave]) -> float:
    return sum(sum(w.tokens) for w in waves) / sum(w.wall_s for w in waves)


def report(clients: int, peer: list[Wave], ours: list[Wave], streamed: list[Wave]) -> bool:
    stages: dict[str, list[float]] = {}
    for result in flat(ours, "results"):
        for name, value in stage_ms(result).items():
            stages.setdefault(name, []).append(value)
    count = len(flat(ours, "results"))
    prompt = statistics.mean(flat(peer, "prompt_tokens"))
    print(f"\n{clients} client{'s' if clients > 1 else ''}, {count} requests, prompts of {prompt:.0f} tokens")
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
    walls = [s * 1000 for s in flat(ours, "latency_s")]
    peers = [s * 1000 for s in flat(peer, "latency_s")]
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
    ttft = [s * 1000 for s in flat(streamed, "ttft_s")]
    peer_ttft = [s * 1000 for s in flat(peer, "ttft_s")]
    print(
        f"{'TTFT streamed':<14}{percentile(ttft, 50):>10.1f}{percentile(ttft, 99):>10.1f}"
        f"   LLMEngine directly: p50 {percentile(peer_ttft, 50):.1f} ms, "
        f"p99 {percentile(peer_ttft, 99):.1f} ms"
    )
    peer_rate = tokens_per_second(peer)
    print(f"tokens/s      LLMEngine directly {peer_rate:.1f}")
    rate = tokens_per_second(ours)
    line = f"tokens/s      infer through the stack {rate:.1f}: {rate / peer_rate:.2f}x"
    if clients == 32:
        within = rate / peer_rate >= THROUGHPUT_TARGET
        ok &= within
        line += f"   target >= {THROUGHPUT_TARGET:g}x   {'PASS' if within else 'under'}"
    print(line)
    rate = tokens_per_second(streamed)
    print(f"tokens/s      infer_stream through the stack {rate:.1f}: {rate / peer_rate:.2f}x")
    if clients == 1:
        ok &= report_first_token(streamed, statistics.median(peer_ttft))
    return ok


def report_first_token(streamed: list[Wave], peer_ttft_ms: float) -> bool:
    """Where a lone streamed request's time to first token goes, hop by hop (p50 of each), and what
    the pipeline adds to the in-process engine's TTFT on the same input."""
    results = flat(streamed, "results")
    client = statistics.median(s * 1000 for s in flat(streamed, "ttft_s"))
    hops = {
        "reception (validation to job id)": [r.metrics.reception_latency_ms for r in results],
        "queue (enqueue, Redis, dispatcher)": [r.metrics.queue_latency_ms for r in results],
        "router Plan": [r.metrics.router_latency_ms for r in results],
        "preparation Prepare": [r.metrics.expert_load_latency_ms for r in results],
        "engine TTFT (its queue + prefill)": [r.metrics.ttft_ms for r in results],
    }
    print("\ntime to first token of a lone streamed request, p50 of each hop:")
    accounted = 0.0
    for name, values in hops.items():
        accounted += statistics.median(values)
        print(f"  {name:<38}{statistics.median(values):>9.1f} ms")
    print(f"  {'the rest (gRPC hops, delta via Redis)':<38}{client - accounted:>9.1f} ms")
    print(f"  {'client TTFT':<38}{client:>9.1f} ms   LLMEngine directly {peer_ttft_ms:.1f} ms")
    added = client - peer_ttft_ms
    within = added <= TTFT_ADDED_TARGET_MS
    print(
        f"  added by the pipeline {added:+.1f} ms   target <= {TTFT_ADDED_TARGET_MS:g} ms   "
        f"{'PASS' if within else 'over'}"
    )
    return within


class Fronts:
    """The HTTP front against gRPC on the same tiny job (one new token, a prompt every engine step has
    cached): what is left is each front's own cost per request. The two alternate by wave."""

    def __init__(self, target: str, http_url: str, clients: int) -> None:
        import httpx

        from expert_system import ExpertClient

        self.client = ExpertClient(target)
        self.http = httpx.Client(base_url=http_url, limits=httpx.Limits(max_connections=clients), timeout=60)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]
        self.pool = ThreadPoolExecutor(clients)
        self.clients = clients
        for front in ("grpc", "http"):
            self.one(front)  # warm-up: connections, the prompt's blocks in the prefix cache

    def one(self, front: str) -> float:
        began = time.perf_counter()
        if front == "grpc":
            result = self.client.infer(prompt=FRONT_PROMPT, temperature=0.0, max_tokens=1)
            if result.status != "completed":
                raise RuntimeError(f"job ended {result.status}: {result.error}")
        else:
            response = self.http.post(
                "/v1/chat/completions",
                json={
                    "model": self.model,
                    "messages": [{"role": "user", "content": FRONT_PROMPT}],
                    "temperature": 0.0,
                    "max_tokens": 1,
                },
            )
            response.raise_for_status()
        return (time.perf_counter() - began) * 1000

    def measure(self, requests: int) -> dict[str, list[float]]:
        """`requests` calls of each front. Every wave mixes them, half and half, so that both meet
        the same engine at the same moment (at 16 clients the latency is the engine's, and it moves
        between waves by more than the difference measured); at 1 client they alternate."""
        latencies: dict[str, list[float]] = {"grpc": [], "http": []}
        fronts = ["grpc", "http"] * max(1, self.clients // 2)
        for wave in range(max(1, 2 * requests // len(fronts))):
            order = fronts if wave % 2 == 0 else fronts[::-1]
            if self.clients == 1:
                timed = [(front, self.one(front)) for front in order]
            else:
                timed = list(self.pool.map(lambda front: (front, self.one(front)), order))
            for front, ms in timed:
                latencies[front].append(ms)
        return latencies

    def close(self) -> None:
        self.pool.shutdown()
        self.http.close()
        self.client.close()


FRONT_PROMPT = "Say one word."
HTTP_OVERHEAD_TARGET_MS = 2.0  # p50, HTTP against gRPC


def report_fronts(clients: int, latencies: dict[str, list[float]]) -> bool:
    grpc_p50, http_p50 = (statistics.median(latencies[f]) for f in ("grpc", "http"))
    added = http_p50 - grpc_p50
    within = added <= HTTP_OVERHEAD_TARGET_MS
    print(
        f"HTTP front, {clients} client{'s' if clients > 1 else ''}, {len(latencies['http'])} requests of one "
        f"token: gRPC p50 {grpc_p50:.1f} ms, HTTP p50 {http_p50:.1f} ms: {added:+.1f} ms   "
        f"target <= {HTTP_OVERHEAD_TARGET_MS:g} ms   {'PASS' if within else 'over'}"
    )
    return within


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
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--front-clients", type=int, nargs="*", default=[1, 16], help="HTTP against gRPC")
    parser.add_argument("--front-requests", type=int, default=64, help="per front and client count")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tools.stack import LocalStack

    batch = prompts(max(args.requests, max(args.clients)))
    slots = max(args.clients)
    direct = Direct(args.model, slots, args.max_tokens)
    figures, front_figures = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as logs:
        # As `make run` starts it: the trainer too (idle, it still heartbeats and polls Redis).
        stack = LocalStack.on_free_ports(
            Path(logs),
            env=stack_env(args.model, args.threads, max([slots, *args.front_clients])),
            trainer=True,
        )
        stack.start(timeout=600)
        try:
            for clients in args.clients:
                through = Through(stack.target("reception"), args.max_tokens, clients)
                try:
                    figures[clients] = measure(direct, through, batch, clients)
                finally:
                    through.close()
            for clients in args.front_clients:
                fronts = Fronts(stack.target("reception"), stack.http_url("reception"), clients)
                try:
                    front_figures[clients] = fronts.measure(args.front_requests)
                finally:
                    fronts.close()
        finally:
            stack.stop()
    print(
        f"\npipeline overhead, {args.model}, fp32, CPU, {args.threads} engine threads: greedy, "
        f"{args.max_tokens} new tokens, chat template; peer: LLMEngine in-process on the same input"
    )
    ok = all([report(c, *figures[c]) for c in args.clients])
    print()
    ok = all([report_fronts(c, front_figures[c]) for c in args.front_clients]) and ok
    print(f"\n{'all within budget' if ok else 'some figures over budget'}")


if __name__ == "__main__":
    main()
