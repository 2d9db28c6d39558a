"""Tokens/s with and without speculative decoding (the n-gram drafter), greedy, on one engine.

    python bench/speculative.py [--model DIR] [--batch 1 8] [--max-tokens 96] [--threads 2]

Each workload runs twice on the same engine (EXPERT_SPECULATIVE=ngram): with speculation turned off
per request, then with it on; the outputs must be identical, and the script says so. Workloads:
extraction (JSON from a paragraph, where the output copies the input) and free chat. Only the
n-gram drafter exists so far. Figures are only meaningful on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

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


def timed(engine: LLMEngine, chats, params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    started = time.perf_counter()
    outs = engine.chat(chats, params)
    elapsed = time.perf_counter() - started
    ids = [o.outputs[0].token_ids for o in outs]
    return elapsed, sum(len(i) for i in ids), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    engine = LLMEngine.from_pretrained(
        args.model,
        num_threads=args.threads,
        speculative="ngram",
        speculative_k=args.k,
        enable_prefix_caching=False,  # the second run of a workload must prefill as the first did
    )
    on = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    off = dataclasses.replace(on, speculative=False)
    engine.chat(workload("chat", 1), dataclasses.replace(off, max_tokens=4))  # warm-up
    print(
        f"{'workload':<11} {'batch':>5} {'off tok/s':>10} {'ngram tok/s':>12} {'ratio':>6} {'kept':>5} same"
    )
    for name in ("extraction", "chat"):
        for batch in args.batch:
            chats = workload(name, batch)
            t_off, n_off, ids_off = timed(engine, chats, off)
            before = engine.get_stats().speculative
            t_on, n_on, ids_on = timed(engine, chats, on)
            after = engine.get_stats().speculative
            drafted = after.drafted_tokens_total - before.drafted_tokens_total
            accepted = after.accepted_tokens_total - before.accepted_tokens_total
            rate = f"{accepted / drafted:.0%}" if drafted else "-"
            print(
                f"{name:<11} {batch:>5} {n_off / t_off:>10.1f} {n_on / t_on:>12.1f} "
                f"{t_off / t_on * n_on / n_off:>5.2f}x {rate:>5} {ids_on == ids_off}"
            )


if __name__ == "__main__":
    main()
