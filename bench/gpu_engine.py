"""Our engine in bench/gpu.py (a part of it): started for the bench's requests, timed, profiled.
`bench` is the run's Bench (bench/gpu.py): its device, sizes and scratch folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_models import engine_class, random_prompts

# What the profiler trace calls device activity; CPU ops, runtime calls and annotations are not.
DEVICE_ACTIVITY = {"kernel", "gpu_memcpy", "gpu_memset"}


def our_engine(bench, directory: Path, dtype: str, max_num_seqs: int, weights=None, **settings):
    """Our engine on `directory` (its weights read from there, or taken from `weights` in memory,
    gpu_models.engine_class) sized for the bench's requests; and the seconds it took to start."""
    if bench.smoke:
        settings |= {"kernels": "triton", "cuda_graphs": "on"}
    started = time.monotonic()
    engine = engine_class(weights).from_pretrained(
        str(directory),
        device=bench.device.type,
        dtype=dtype,
        max_model_len=max(256, 2 * (bench.prompt + bench.new) + 16),
        max_num_seqs=max_num_seqs,
        num_blocks=max_num_seqs * -(-(bench.prompt + bench.new + 2) // 16) + 64,
        enable_prefix_caching=False,
        **settings,
    )
    return engine, time.monotonic() - started


def our_decode_rate(bench, engine, vocab: int, seed: int) -> float:
    """Batch-1 decode tokens/s: (time of 129 new tokens - time of 1) / 128, best of three
    (of one with --smoke)."""
    from libs.engine import SamplingParams

    def timed(tokens: int, prompt: list[int]) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        bench.sync()
        start = time.perf_counter()
        engine.generate([prompt], params)
        bench.sync()
        return time.perf_counter() - start

    timed(bench.new + 1, random_prompts(1, bench.prompt, vocab, seed)[0])  # warm-up
    rates = []
    for i in range(bench.repeats):
        prompt = random_prompts(1, bench.prompt, vocab, seed + 1 + i)[0]
        rates.append(bench.new / (timed(bench.new + 1, prompt) - timed(1, prompt)))
    return max(rates)


def our_throughput(bench, engine, requests: int, vocab: int, seed: int, experts=None) -> float:
    """Generated tokens/s of `requests` requests together, prefill included (fresh prompts)."""
    from libs.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=bench.new, ignore_eos=True)
    prompts = random_prompts(requests, bench.prompt, vocab, seed)
    bench.sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, experts=experts)
    bench.sync()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def device_busy_us(trace_events: list[dict]) -> float:
    """Microseconds in which the device runs a kernel, a copy or a memset (DEVICE_ACTIVITY), their
    overlaps merged, from a Chrome trace's events: never CPU ops, runtime calls or annotations."""
    intervals = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in trace_events
        if e.get("cat") in DEVICE_ACTIVITY and e.get("dur", 0) > 0
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in intervals:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy


def busy_share(bench, engine, requests: int, vocab: int, steps: int) -> float:
    """The device-busy share of `steps` decode steps of `requests` sequences: device activity in the
    profiler's trace over the wall time of the profiled steps (0 on the CPU, which has none)."""
    from torch.profiler import ProfilerActivity, profile

    from libs.engine import SamplingParams

    settle = 2 if bench.smoke else 8
    params = SamplingParams(temperature=0.0, max_tokens=bench.new + steps + settle, ignore_eos=True)
    ids = [f"busy-{i}" for i in range(requests)]
    for request_id, prompt in zip(ids, random_prompts(requests, bench.prompt, vocab, 99), strict=True):
        engine.add_request(request_id, prompt, params)
    try:
        while engine.get_stats().num_waiting:
            engine.step()
        for _ in range(settle):
            engine.step()  # the last prefill chunks: then every sequence is decoding
        bench.sync()
        # Device activity only: CPU ops are not recorded at all on the GPU.
        activity = ProfilerActivity.CUDA if bench.device.type == "cuda" else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            bench.sync()
            wall_us = (time.perf_counter() - start) * 1e6
    finally:
        engine.abort_request(ids)
        engine.step()
    trace = bench.root / "busy_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return device_busy_us(events) / wall_us
