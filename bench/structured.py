"""Structured output on the default model, measured in one run.

1. Mask time per token: for each of the 5 schemas of bench/data/structured_cases.json, the time to
   fill one row's token bitmask (llguidance, the model's 49,152-token vocabulary) at every position
   of the constrained outputs, p50 and p99.
2. Throughput: 32 concurrent requests, all constrained to their schema, against the same 32
   unconstrained, greedy, in the same run (generated tokens per second of wall time).

    python bench/structured.py --model data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from libs.engine import LLMEngine, SamplingParams
from libs.engine.grammar import bitmask_width
from libs.structured_output import StructuredOutput, text_problem

TARGETS = {"mask_p50_us": 100.0, "throughput_ratio": 0.85, "valid": 1.0}
CASES = Path(__file__).resolve().parent / "data" / "structured_cases.json"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def mask_times(
    engine: LLMEngine, structured: StructuredOutput, outputs: list[list[int]], repeats: int
) -> list[float]:
    """Microseconds per bitmask fill along each output, the way the runner fills a row."""
    compiled = engine.grammars.compile(structured)
    bitmask = torch.empty((1, bitmask_width(engine.model_config.vocab_size)), dtype=torch.int32)
    times = []
    for _ in range(repeats):
        for tokens in outputs:
            matcher = compiled.matcher()
            for token in tokens:
                started = time.perf_counter()
                matcher.fill(bitmask, 0)
                times.append((time.perf_counter() - started) * 1e6)
                if not matcher.accept(token):
                    break
    return times


def run(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> tuple[list, float]:
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return outputs, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="passes over the outputs when timing masks")
    args = parser.parse_args()

    data = json.loads(CASES.read_text())
    # No prefix cache: the second run must prefill its prompts as the first did.
    engine = LLMEngine.from_pretrained(
        args.model, max_model_len=1024, num_blocks=1024, max_num_seqs=64, enable_prefix_caching=False
    )
    # The schemas interleaved (the file holds 10 cases of each in turn), so that every batch mixes them.
    count = len(data["cases"])
    order = sorted(range(count), key=lambda i: (i % 10, i // 10))
    cases = [data["cases"][order[i % count]] for i in range(args.requests)]
    prompts = [[{"role": "user", "content": c["prompt"]}] for c in cases]
    formats = [StructuredOutput("json_schema", json.dumps(data["schemas"][c["schema"]])) for c in cases]
    constrained = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=f) for f in formats]

    run(engine, prompts, constrained)  # warm-up (first-batch costs), and every format compiled
    con_out, con_s = run(engine, prompts, constrained)
    # The same requests unconstrained, each made to generate exactly as many tokens as its
    # constrained twin: the same batch, step by step, so the ratio is the cost of the masks alone.
    lengths = [len(o.outputs[0].token_ids) for o in con_out]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    free_out, free_s = run(engine, prompts, free)
    free_tokens = sum(len(o.outputs[0].token_ids) for o in free_out)
    con_tokens = sum(lengths)
    free_tps, con_tps = free_tokens / free_s, con_tokens / con_s
    valid = sum(text_problem(f, o.outputs[0].text) is None for f, o in zip(formats, con_out, strict=True))

    print(f"structured output on {Path(args.model).name}, {torch.get_num_threads()} threads")
    print("\nmask time per token (llguidance, one row, µs)")
    print(f"{'schema':<10} {'tokens':>7} {'p50':>8} {'p99':>8}")
    worst_p50 = 0.0
    for name, schema in data["schemas"].items():
        structured = StructuredOutput("json_schema", json.dumps(schema))
        outputs = [o.outputs[0].token_ids for f, o in zip(formats, con_out, strict=True) if f == structured]
        times = mask_times(engine, structured, outputs, args.repeats)
        p50, p99 = statistics.median(times), percentile(times, 0.99)
        worst_p50 = max(worst_p50, p50)
        print(f"{name:<10} {len(times) // args.repeats:>7} {p50:>8.1f} {p99:>8.1f}")

    print(
        f"\n{args.requests} concurrent requests, greedy, max_tokens {args.max_tokens} (unconstrained: as many"
    )
    print("tokens per request as its constrained twin)")
    print(f"{'':<14} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    print(f"{'unconstrained':<14} {free_tokens:>7} {free_s:>8.2f} {free_tps:>8.1f}")
    print(f"{'constrained':<14} {con_tokens:>7} {con_s:>8.2f} {con_tps:>8.1f}")
    ratio = con_tps / free_tps
    print(f"\nvalid outputs: {valid}/{len(cases)} (target 100%)")
    print(f"constrained / unconstrained throughput: {ratio:.2f}x (target >= {TARGETS['throughput_ratio']}x)")
    print(f"worst mask p50: {worst_p50:.1f} µs (target <= {TARGETS['mask_p50_us']:.0f} µs)")


if __name__ == "__main__":
    main()
