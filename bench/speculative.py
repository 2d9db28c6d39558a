"""Tokens/s with and without speculative decoding, greedy, for each drafter, in one run.

    python bench/speculative.py [--model DIR] [--batch 1 8] [--max-tokens 96] [--threads 2]
        [--drafters ngram base int4 draft:DIR]

One engine per drafter (EXPERT_SPECULATIVE=<drafter>). Each workload runs twice on it: with
speculation turned off per request, then with it on; the outputs must be identical, and the script
says so, with the acceptance rate (drafts kept / drafted). Batch b runs each workload's prompts b
at a time (batch 1: every prompt alone, one after another). Workloads: extraction (JSON from a
paragraph, where the output copies the input), free chat, and an expert request (free chat with a
random rank-8 LoRA expert made and signed for the run, as bench/adapters.py makes them). The base
drafter drafts only for the expert workload (the others use the n-gram drafter: see
docs/engine.md#speculative-decoding). Figures are only meaningful on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from pathlib import Path

from libs.engine.config import DEFAULT_MODEL
from libs.engine.llm_engine import LLMEngine
from libs.engine.sampling_params import SamplingParams

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
    engine: LLMEngine, chats, params: SamplingParams, experts, batch: int
) -> tuple[float, int, list[list[int]]]:
    """Runs the chats `batch` at a time, one batch after another; the time and tokens of all."""
    prompts = [engine.tokenizer.encode_chat(c) for c in chats]
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


def run_drafter(args: argparse.Namespace, drafter: str, expert: tuple[Path, Path]) -> None:
    engine = LLMEngine.from_pretrained(
        args.model,
        num_threads=args.threads,
        speculative=drafter,
        speculative_k=args.k,
        speculative_max_rows=args.max_rows,
        enable_prefix_caching=False,  # the second run of a workload must prefill as the first did
    )
    engine.load_expert(*expert)
    on = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    off = dataclasses.replace(on, speculative=False)
    engine.chat(workload("chat", 1), dataclasses.replace(off, max_tokens=4))  # warm-up
    for name in WORKLOADS:
        for batch in args.batch:
            # Every distinct prompt of the workload at least once: batch 1 runs them one by one.
            source = "chat" if name == "expert" else name
            chats = workload(source, max(batch, len(PARAGRAPHS if source == "extraction" else CHATS)))
            experts = [[(EXPERT, 1.0)]] * len(chats) if name == "expert" else None
            t_off, n_off, ids_off = timed(engine, chats, off, experts, batch)
            before = counters(engine)
            t_on, n_on, ids_on = timed(engine, chats, on, experts, batch)
            drafted, accepted = (a - b for a, b in zip(counters(engine), before, strict=True))
            rate = f"{accepted / drafted:.0%}" if drafted else "-"
            print(
                f"{drafter[:14]:<14} {name:<11} {batch:>5} {n_off / t_off:>10.1f} {n_on / t_on:>10.1f} "
                f"{t_off / t_on * n_on / n_off:>5.2f}x {rate:>9} {ids_on == ids_off}",
                flush=True,
            )
    del engine
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=16, help="EXPERT_SPECULATIVE_MAX_ROWS")
    parser.add_argument("--drafters", nargs="+", default=["ngram", "base", "int4"])
    args = parser.parse_args()
    print(
        f"{'drafter':<14} {'workload':<11} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} "
        f"{'accepted':>9} same"
    )
    with tempfile.TemporaryDirectory() as tmp:
        expert = bench_expert(args.model, Path(tmp))
        for drafter in args.drafters:
            run_drafter(args, drafter, expert)


if __name__ == "__main__":
    main()
