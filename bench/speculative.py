"""Tokens/s with and without speculative decoding, greedy, for each drafter, in one run, and
against llama.cpp's prompt-lookup decoding.

    python bench/speculative.py [--model DIR] [--batch 1 8] [--max-tokens 96] [--threads 2]
        [--drafters ngram base int4 draft:DIR] [--quantization none|int8|int4]
        [--llama-cpp-venv DIR]

One engine per drafter (EXPERT_SPECULATIVE=<drafter>). Each workload runs twice on it: with
speculation turned off per request, then with it on; the outputs must be identical, and the script
says so, with the acceptance rate (drafts kept / drafted). Batch b runs each workload's prompts b
at a time (batch 1: every prompt alone, one after another). Workloads: extraction (JSON from a
paragraph, where the output copies the input), free chat, and an expert request (free chat with a
random rank-8 LoRA expert made and signed for the run, as bench/adapters.py makes them). The base
drafter drafts only for the expert workload (the others use the n-gram drafter: see
docs/engine.md#speculative-decoding). --quantization picks our weights (float32, int8 or int4).

With --llama-cpp-venv DIR (bench/llama_cpp_peer.py says how to build DIR), llama.cpp runs the same
extraction and chat prompts (our token ids, as encode_chat makes them) at batch 1 at the same bits
(F32, Q8_0 or Q4_1: bench/engine_throughput.py's mapping), in DIR's python, right after each
drafter's engine is freed (bench/llama_cpp_speculative.py): with llama-cpp-python's `Llama` class
plain, and with `draft_model=LlamaPromptLookupDecoding(...)`, llama.cpp's own way of using prompt
lookup (num_pred_tokens = our --k, max_ngram_size its default). Both rows go through the `Llama`
class, since prompt lookup exists only there, though the class adds about a quarter to the plain
decoding of llama.cpp's C API (which bench/engine_throughput.py measures). Both sides then ignore
the end-of-sequence token, so every prompt yields --max-tokens new tokens on both. A second table
prints, per drafter and workload, llama.cpp's tok/s without and with prompt lookup, ours without
and with speculation, the ratio ours-on / llama.cpp-prompt-lookup with PASS or short against
TARGETS (the expert workload is ours only: "-"), and whether llama.cpp's greedy ids equal ours
(expected for F32 only: quantized formats differ).

Figures are only meaningful on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import tempfile
import time
from pathlib import Path

from libs.engine.config import DEFAULT_MODEL
from libs.engine.llm_engine import LLMEngine
from libs.engine.sampling_params import SamplingParams

# Batch 1: our speculative tok/s / llama.cpp's prompt-lookup tok/s.
TARGETS = {"extraction": 2.0, "chat": 1.2}

PARAGRAPHS = [
    "Invoice INV-2291 was issued by Acme Corp on 12 March 2024 to Bob Smith, 14 Elm Street, Leeds, "
    "for 431.50 EUR, payable within 30 days to account DE44 5001 0517 5407 3249 31.",
    "Order 77-ALPHA from Northwind Traders ships on 3 June 2025 to Carla Diaz, 9 Rue Verte, Lyon; "
    "it holds 12 units of part XK-400 at 19.99 USD each, tracking number 1Z999AA10123456784.",
]
CHATS = ["Tell me about the sea.", "Why do cats purr?", "Describe a busy market.", "What is rain?"]


WORKLOADS = ("extraction", "chat", "expert")
EXPERT = "bench-lora-0"  # the name bench/adapters.py gives its first package


def workload(name: str, batch: int) -> list[list[dict[str, str]]]:
    if name == "extraction":
        texts = [
            "Return a JSON object with every name, date, amount and identifier in this text, copied "
            f"exactly: {PARAGRAPHS[i % len(PARAGRAPHS)]}"
            for i in range(batch)
        ]
    else:
        texts = [CHATS[i % len(CHATS)] for i in range(batch)]
    return [[{"role": "user", "content": t}] for t in texts]


def timed(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, experts, batch: int
) -> tuple[float, int, list[list[int]]]:
    """Runs the prompts `batch` at a time, one batch after another; the time and tokens of all."""
    elapsed, ids = 0.0, []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        started = time.perf_counter()
        outs = engine.generate(group, params, experts=None if experts is None else experts[: len(group)])
        elapsed += time.perf_counter() - started
        ids += [o.outputs[0].token_ids for o in outs]
    return elapsed, sum(len(i) for i in ids), ids


def counters(engine: LLMEngine) -> tuple[int, int]:
    """Drafted and accepted tokens so far, the base drafter's n-gram fallback included."""
    stats = [engine.get_stats().speculative, engine.speculator.fallback_snapshot()]
    return (
        sum(s.drafted_tokens_total for s in stats if s is not None),
        sum(s.accepted_tokens_total for s in stats if s is not None),
    )


def bench_expert(model: str, root: Path) -> tuple[Path, Path]:
    """A signed random LoRA package for `model` and its trusted-keys directory."""
    from adapters import make_adapters, make_packages  # bench/adapters.py, next to this script

    packages, trusted = make_packages(model, make_adapters(model, root, 1, 8), root)
    return packages[0], trusted


def run_drafter(args: argparse.Namespace, drafter: str, expert: tuple[Path, Path]) -> dict[str, dict]:
    """Prints the drafter's rows; returns, per workload, its batch-1 prompts, tok/s and ids."""
    engine = LLMEngine.from_pretrained(
        args.model,
        quantization=None if args.quantization == "none" else args.quantization,
        num_threads=args.threads,
        speculative=drafter,
        speculative_k=args.k,
        speculative_max_rows=args.max_rows,
        enable_prefix_caching=False,  # the second run of a workload must prefill as the first did
    )
    engine.load_expert(*expert)
    # With llama.cpp alongside, both sides make exactly --max-tokens tokens per prompt.
    on = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=bool(args.llama_cpp_venv))
    off = dataclasses.replace(on, speculative=False)
    single = {}
    engine.chat(workload("chat", 1), dataclasses.replace(off, max_tokens=4))  # warm-up
    for name in WORKLOADS:
        for batch in args.batch:
            # Every distinct prompt of the workload at least once: batch 1 runs them one by one.
            source = "chat" if name == "expert" else name
            chats = workload(source, max(batch, len(PARAGRAPHS if source == "extraction" else CHATS)))
            prompts = [engine.tokenizer.encode_chat(c) for c in chats]
            experts = [[(EXPERT, 1.0)]] * len(chats) if name == "expert" else None
            t_off, n_off, ids_off = timed(engine, prompts, off, experts, batch)
            before = counters(engine)
            t_on, n_on, ids_on = timed(engine, prompts, on, experts, batch)
            drafted, accepted = (a - b for a, b in zip(counters(engine), before, strict=True))
            rate = f"{accepted / drafted:.0%}" if drafted else "-"
            print(
                f"{drafter[:14]:<14} {name:<11} {batch:>5} {n_off / t_off:>10.1f} {n_on / t_on:>10.1f} "
                f"{t_off / t_on * n_on / n_off:>5.2f}x {rate:>9} {ids_on == ids_off}",
                flush=True,
            )
            if batch == 1:
                single[name] = {"prompts": prompts, "off": n_off / t_off, "on": n_on / t_on, "ids": ids_off}
    del engine
    gc.collect()
    return single


def llama_cpp_runs(args: argparse.Namespace, ours: dict[str, dict]) -> dict:
    """llama.cpp's batch-1 runs of our extraction and chat prompts (bench/llama_cpp_speculative.py)."""
    from engine_throughput import llama_cpp_gguf  # bench/engine_throughput.py, next to this script
    from engine_throughput import run_llama_cpp as run_in_venv

    job = llama_cpp_gguf(args.quantization) | {
        "threads": args.threads,
        "new_tokens": args.max_tokens,
        "num_pred_tokens": args.k,
        "workloads": {name: ours[name]["prompts"] for name in TARGETS},
    }
    return run_in_venv(args.llama_cpp_venv, "llama_cpp_speculative.py", job)


def print_comparison(args: argparse.Namespace, runs: list[tuple[str, dict, dict]]) -> None:
    """The second table: per drafter and workload, llama.cpp's and our batch-1 tok/s and the ratio."""
    from engine_throughput import LLAMA_CPP_TYPE

    lookup = runs[0][2]["lookup"]
    print(
        f"\nbatch 1 against llama.cpp {LLAMA_CPP_TYPE[args.quantization]} (ours: {args.quantization}), "
        f"greedy, {args.max_tokens} new tokens per prompt, end-of-sequence ignored; llama.cpp through "
        f"its Llama class, prompt lookup = LlamaPromptLookupDecoding("
        f"{', '.join(f'{k}={v}' for k, v in lookup.items())}) (num_pred_tokens = our --k)"
    )
    print(
        f"{'drafter':<14} {'workload':<11} {'llama off':>9} {'llama on':>9} {'ours off':>9} {'ours on':>9} "
        f"{'ours on / llama on':>18} {'target':>7} {'':>6} {'llama=ours':>10}"
    )
    for drafter, ours, llama in runs:
        for name, mine in ours.items():
            peer = llama["workloads"].get(name)
            if peer is None:
                print(
                    f"{drafter[:14]:<14} {name:<11} {'-':>9} {'-':>9} {mine['off']:>9.1f} {mine['on']:>9.1f} "
                    f"{'-':>18} {'-':>7} {'-':>6} {'-':>10}"
                )
                continue
            ratio = mine["on"] / peer["on"]
            verdict = "PASS" if ratio >= TARGETS[name] else "short"
            print(
                f"{drafter[:14]:<14} {name:<11} {peer['off']:>9.1f} {peer['on']:>9.1f} {mine['off']:>9.1f} "
                f"{mine['on']:>9.1f} {ratio:>17.2f}x {TARGETS[name]:>6.1f}x {verdict:>6} "
                f"{peer['ids_off'] == mine['ids']!s:>10}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=16, help="EXPERT_SPECULATIVE_MAX_ROWS")
    parser.add_argument("--drafters", nargs="+", default=["ngram", "base", "int4"])
    parser.add_argument("--quantization", choices=("none", "int8", "int4"), default="none")
    parser.add_argument(
        "--llama-cpp-venv", type=Path, help="a venv with llama-cpp-python (see bench/llama_cpp_peer.py)"
    )
    args = parser.parse_args()
    if args.llama_cpp_venv:
        if not (args.llama_cpp_venv / "bin" / "python").is_file():
            parser.error(f"--llama-cpp-venv: {args.llama_cpp_venv}/bin/python does not exist")
        if 1 not in args.batch:
            parser.error("--batch: the comparison with llama.cpp needs batch 1")
        if os.path.realpath(args.model) != os.path.realpath(DEFAULT_MODEL):
            parser.error(f"--model: llama.cpp runs the default model's GGUF only ({DEFAULT_MODEL})")
    print(
        f"{'drafter':<14} {'workload':<11} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} "
        f"{'accepted':>9} same"
    )
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        expert = bench_expert(args.model, Path(tmp))
        for drafter in args.drafters:
            ours = run_drafter(args, drafter, expert)
            if args.llama_cpp_venv:
                runs.append((drafter, ours, llama_cpp_runs(args, ours)))
    if runs:
        print_comparison(args, runs)


if __name__ == "__main__":
    main()
