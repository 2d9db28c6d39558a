"""The 8-bit KV cache against the float32 one: long-context 32-way throughput, in one run.

    python bench/kv_cache.py [--model DIR] [--requests 32] [--prompt-tokens 2000] [--new-tokens 128]

Two engines on the same checkpoint (float32 weights, native kernels), one with
EXPERT_KV_CACHE_DTYPE=auto (K and V in float32) and one with int8, each with blocks for every
sequence at once, so neither preempts. The same distinct random prompts go to both, all submitted
together, greedy with ignore_eos. Printed per cache: the KV bytes per token; decode throughput
(generated tokens over the time of the steps that only decode: there attention reads every
sequence's whole context, the part the int8 cache speeds up); end-to-end throughput (generated
tokens over the whole run, the prefill of every prompt included, which is compute-bound and which
the int8 cache does not speed up); and how many tokens a 1 GiB cache holds. Then the int8 / float32
ratios. Target: decode throughput >= 1.3x. Figures are only meaningful on an idle machine.
"""

from __future__ import annotations

import argparse
import gc
import time

from engine_throughput import prompts_of  # bench/engine_throughput.py, next to this script

from libs.engine import LLMEngine, SamplingParams
from libs.engine.config import DEFAULT_MODEL

GIB = 1 << 30


def run(args: argparse.Namespace, kv_cache_dtype: str) -> dict[str, float]:
    context = args.prompt_tokens + args.new_tokens
    block_size = 16
    engine = LLMEngine.from_pretrained(
        args.model,
        num_threads=args.threads,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=context + block_size,
        max_num_seqs=args.requests,
        num_blocks=args.requests * (context // block_size + 2),
        enable_prefix_caching=False,
    )
    engine.generate([[100, 200, 300]] * 2, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts_of(vocab, args.requests, args.prompt_tokens, seed=7)):
        engine.add_request(f"r{i}", prompt, params)
    counts: dict[str, int] = {}
    decode_time = total_time = 0.0
    decode_generated = 0
    while engine.has_unfinished_requests():
        # A step that only decodes: every request admitted and every prompt computed.
        decoding = not engine.scheduler.waiting and all(
            s.num_uncomputed_tokens == 1 for s in engine.scheduler.running
        )
        before = sum(counts.values())
        started = time.perf_counter()
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - started
        total_time += elapsed
        if decoding:
            decode_time += elapsed
            decode_generated += sum(counts.values()) - before
    generated = sum(counts.values())
    per_token = engine.model_info.kv_bytes_per_block / block_size
    result = {
        "bytes_per_token": per_token,
        "decode": decode_generated / decode_time,
        "end_to_end": generated / total_time,
        "tokens_per_gib": GIB / per_token,
    }
    del engine
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    results = {dtype: run(args, dtype) for dtype in ("auto", "int8")}
    print(
        f"{args.requests} requests x {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
        f"{args.threads} threads"
    )
    header = f"{'KV cache':<10} {'bytes/token':>12} {'decode tok/s':>13} {'end-to-end tok/s':>17}"
    print(f"{header} {'tokens/GiB':>11}")
    for dtype, r in results.items():
        name = "float32" if dtype == "auto" else dtype
        print(
            f"{name:<10} {r['bytes_per_token']:>12,.0f} {r['decode']:>13.1f} {r['end_to_end']:>17.1f} "
            f"{r['tokens_per_gib']:>11,.0f}"
        )
    fp, q = results["auto"], results["int8"]
    print(
        f"int8 / float32: bytes per token {q['bytes_per_token'] / fp['bytes_per_token']:.2f}x, decode "
        f"{q['decode'] / fp['decode']:.2f}x (target >= 1.3x), "
        f"end-to-end {q['end_to_end'] / fp['end_to_end']:.2f}x"
    )


if __name__ == "__main__":
    main()
