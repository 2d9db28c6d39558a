"""Engine throughput on the default model against transformers, measured in the same run.

Prints batch-1 decode tokens/s, the 32-request throughput (128-token prompts, 128 new tokens,
ignore_eos) against transformers `generate` at batch 16, and the weight-streaming roofline
(weight bytes / memory bandwidth, both measured here) with our fraction of it. fp32, CPU.

    python bench/engine_throughput.py --model data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

TARGETS = {
    "decode_vs_transformers": 2.0,
    "decode_vs_roofline": 0.65,
    "throughput_vs_transformers": 1.7,
}


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of several `sum` passes over a buffer far larger than cache."""
    buffer = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def streamed_weight_bytes(engine) -> int:
    """Bytes a decode step reads: every linear weight (as stored for the kernels) and norm vector."""
    model = engine.model
    total = model.lm_head.weight.numel() * model.lm_head.weight.element_size() + model.norm.numel() * 4
    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += linear.weight.numel() * linear.weight.element_size()
        total += (layer.input_norm.numel() + layer.post_norm.numel()) * 4
    return total


def prompts_of(vocab: int, count: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(count)]


def ours(model_dir: str, new_tokens: int, batch: list[list[int]], repeats: int) -> dict[str, float]:
    from libs.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=len(batch)
    )
    engine.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=8))  # warm up
    single = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        out = engine.generate([batch[0][:16]], single)[0]
        rates.append(out.metrics.decode_tokens_per_second)
    start = time.perf_counter()
    outs = engine.generate(batch, single)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    ttfts = sorted(o.metrics.ttft for o in outs)
    itls = sorted(x for o in outs for x in o.metrics.inter_token_latencies)
    return {
        "decode": statistics.median(rates),
        "throughput": generated / elapsed,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "itl_p50": itls[len(itls) // 2],
        "itl_p99": itls[int(len(itls) * 0.99)],
        "weight_bytes": streamed_weight_bytes(engine),
        "kernels": engine.kernels,
    }


def transformers_peer(
    model_dir: str, new_tokens: int, batch: list[list[int]], repeats: int, batch_size: int
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(rows: list[list[int]], tokens: int) -> float:
        ids = torch.tensor(rows)
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    run([batch[0][:16]], 4)  # warm up
    rates = []
    for _ in range(repeats):
        # decode time = time for 1 + N tokens minus the time for the prefill and first token
        rates.append(new_tokens / (run([batch[0][:16]], new_tokens + 1) - run([batch[0][:16]], 1)))
    start = time.perf_counter()
    for i in range(0, len(batch), batch_size):
        run(batch[i : i + batch_size], new_tokens)
    elapsed = time.perf_counter() - start
    return {"decode": statistics.median(rates), "throughput": len(batch) * new_tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--peer-batch", type=int, default=16, help="transformers batch size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    bandwidth = measure_bandwidth()
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    batch = prompts_of(vocab, args.requests, args.prompt_tokens)
    us = ours(args.model, args.new_tokens, batch, args.repeats)
    peer = transformers_peer(args.model, args.new_tokens, batch, args.repeats, args.peer_batch)
    roofline = bandwidth / us["weight_bytes"]

    ratios = {
        "decode_vs_transformers": us["decode"] / peer["decode"],
        "decode_vs_roofline": us["decode"] / roofline,
        "throughput_vs_transformers": us["throughput"] / peer["throughput"],
    }
    print(f"\nengine throughput, {args.model}, fp32, CPU, {args.threads} threads ({us['kernels']} kernels)")
    print(
        f"memory bandwidth (sum over 1 GiB): {bandwidth / 1e9:.1f} GB/s; weights streamed per decode step: "
        f"{us['weight_bytes'] / 1e6:.0f} MB; roofline {roofline:.1f} tok/s"
    )
    rows = [
        (
            "batch-1 decode tok/s",
            us["decode"],
            peer["decode"],
            "transformers",
            ratios["decode_vs_transformers"],
            "decode_vs_transformers",
        ),
        (
            "batch-1 decode / roofline",
            us["decode"],
            roofline,
            "roofline",
            ratios["decode_vs_roofline"],
            "decode_vs_roofline",
        ),
        (
            f"{args.requests} requests tok/s",
            us["throughput"],
            peer["throughput"],
            f"transformers batch {args.peer_batch}",
            ratios["throughput_vs_transformers"],
            "throughput_vs_transformers",
        ),
    ]
    print(f"{'metric':<28}{'ours':>10}{'peer':>10}  {'peer is':<24}{'ratio':>7}{'target':>8}  result")
    for name, mine, theirs, who, ratio, key in rows:
        target = TARGETS[key]
        verdict = "PASS" if ratio >= target else "short"
        print(f"{name:<28}{mine:>10.1f}{theirs:>10.1f}  {who:<24}{ratio:>6.2f}x{target:>7.2f}x  {verdict}")
    print(
        f"{args.requests}-request run: TTFT p50 {us['ttft_p50'] * 1e3:.0f} ms, "
        f"ITL p50 {us['itl_p50'] * 1e3:.0f} ms, ITL p99 {us['itl_p99'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
