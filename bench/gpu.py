"""The engine on one GPU against its peers, measured in one run (about 5 minutes on an H100 or H200).

Random-weight Llama models of real shapes are built with transformers on the GPU and saved as
checkpoints (nothing comes from a model hub): Llama-3.2-1B's shape with a 49k vocabulary
(1.17 B parameters), Llama-3-8B's, and SmolLM2-135M's for the parity check. One table, with:

- parity: float32 greedy tokens against transformers (identical), and bfloat16 agreement;
- batch-1 decode of the 1.17 B and 8 B shapes, against the HBM bound (weight bytes over the
  bandwidth of a device copy measured here, bytes read plus written);
- 64-way and 256-way throughput (128-token prompts, 128 new tokens);
- 32 requests with 32 distinct LoRAs (rank 8, all seven projections) against the same requests
  without experts;
- the share of a 64-way decode step's wall time in which the GPU is busy (torch.profiler);
- decode-graph capture time and memory;
- attention alone: our paged kernel against gather + SDPA and dense SDPA (bench/gpu_kernels.py);

and the peers, in the same run: transformers `generate` eager, and with its static cache under
`torch.compile` (transformers compiles `generate`'s forward itself with cache_implementation
"static"). Decode rates are (time of 129 new tokens - time of 1) / 128, so prefill is left out
alike for every engine. With $OUT set, the table is also written to $OUT/gpu_bench.json, after
every section (a run cut short keeps what it measured).

    python bench/gpu.py                  # on the GPU machine
    python bench/gpu.py --skip compiled  # without the torch.compile peer (its compile takes minutes)
    python bench/gpu.py --smoke          # the whole flow on the CPU with tiny shapes (Triton's
                                         # interpreter): checks this script, measures nothing
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGETS = {
    "decode_1b_vs_bound": 0.45,
    "decode_8b_vs_bound": 0.70,
    "busy_64": 0.90,
    "lora_vs_base": 0.80,
    "bf16_agreement": 7 / 8,
}
H200_TARGETS = {"decode_1b_tok_s": 800, "throughput_64_tok_s": 7000}

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)
# --smoke: the same flow on tiny shapes, on the CPU.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Bench:
    """The run's settings, its figures as they come, and where they are written."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.root = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
        self.results: dict[str, object] = {"errors": {}}
        self.out = Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT") else None
        self.started = time.monotonic()
        # Sizes: real ones on the GPU, a token's worth on the CPU.
        self.prompt = 8 if self.smoke else 128
        self.new = 8 if self.smoke else 128
        self.wide = (4, 8) if self.smoke else (64, 256)
        self.loras = 4 if self.smoke else 32
        self.checkpoint_1b: Path | None = None
        self.hf_1b = None  # transformers' 1.17 B model, kept for the peers

    def section(self, name: str, run: Callable[[], None]) -> None:
        """Run one part; a failure is recorded and the rest still runs."""
        if name in self.args.skip:
            print(f"-- {name}: skipped", flush=True)
            return
        print(f"-- {name} ({time.monotonic() - self.started:.0f} s in)", flush=True)
        try:
            run()
        except Exception as exc:  # a bench keeps going and reports what broke
            traceback.print_exc()
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"
        self.save()

    def record(self, **figures: object) -> None:
        self.results.update(figures)
        for key, value in figures.items():
            print(f"   {key}: {_fmt(value)}", flush=True)

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps(self.results, indent=2, default=str))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _fmt(value: object) -> str:
    return f"{value:,.3f}" if isinstance(value, float) else str(value)


# -- models ----------------------------------------------------------------------------------------


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer that covers every id of the model (random weights emit any id):
    ChatML's special tokens at 0-2, then one word per id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>"})
    )


def build_checkpoint(bench: Bench, name: str, shape: dict, dtype: torch.dtype, seed: int = 0):
    """A random-weight Llama of `shape` built by transformers on the device and saved as a checkpoint;
    returns (directory, the transformers model in eval mode, its weight bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype, on the device: no host copy
    try:
        with torch.device(bench.device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    directory = bench.root / name
    model.save_pretrained(directory)
    write_tokenizer(directory, shape["vocab_size"])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    return directory, model, weight_bytes


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]


# -- our engine ------------------------------------------------------------------------------------


def our_engine(bench: Bench, checkpoint: Path, dtype: str, max_num_seqs: int, **settings):
    from libs.engine import LLMEngine

    if bench.smoke:
        settings |= {"kernels": "triton", "cuda_graphs": "on"}
    started = time.monotonic()
    engine = LLMEngine.from_pretrained(
        str(checkpoint),
        device=bench.device.type,
        dtype=dtype,
        max_model_len=max(256, 2 * (bench.prompt + bench.new) + 16),
        max_num_seqs=max_num_seqs,
        num_blocks=max_num_seqs * -(-(bench.prompt + bench.new + 2) // 16) + 64,
        enable_prefix_caching=False,
        **settings,
    )
    return engine, time.monotonic() - started


def our_decode_rate(bench: Bench, engine, vocab: int, seed: int) -> float:
    """Batch-1 decode tokens/s: (time of 129 new tokens - time of 1) / 128, best of three."""
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
    for i in range(3):
        prompt = random_prompts(1, bench.prompt, vocab, seed + 1 + i)[0]
        rates.append(bench.new / (timed(bench.new + 1, prompt) - timed(1, prompt)))
    return max(rates)


def our_throughput(bench: Bench, engine, requests: int, vocab: int, seed: int, experts=None) -> float:
    """Generated tokens/s of `requests` requests together, prefill included (fresh prompts)."""
    from libs.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=bench.new, ignore_eos=True)
    prompts = random_prompts(requests, bench.prompt, vocab, seed)
    bench.sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, experts=experts)
    bench.sync()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def busy_share(bench: Bench, engine, requests: int, vocab: int, steps: int = 32) -> float:
    """The share of wall time in which the GPU runs a kernel or a copy, over `steps` decode steps of
    `requests` sequences (torch.profiler's device events, overlaps merged)."""
    from torch.profiler import ProfilerActivity, profile

    from libs.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=bench.new + steps + 8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(requests, bench.prompt, vocab, 99)):
        engine.add_request(f"busy-{i}", prompt, params)
    while engine.get_stats().num_waiting:
        engine.step()
    for _ in range(8):
        engine.step()  # the last prefill chunks: then every sequence is decoding
    bench.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        bench.sync()
        wall_us = (time.perf_counter() - start) * 1e6
    engine.abort_request([f"busy-{i}" for i in range(requests)])
    engine.step()
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in intervals:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / wall_us


# -- experts ---------------------------------------------------------------------------------------


def lora_packages(
    bench: Bench, checkpoint: Path, shape: dict, count: int, rank: int
) -> tuple[list[Path], Path]:
    """`count` signed packages of random rank-`rank` LoRAs on all seven projections, written in
    peft's format (no model load per adapter)."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "bench"))
    from adapters import make_packages

    h, i_size, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i_size),
        "up_proj": (h, i_size),
        "down_proj": (i_size, h),
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": LORA_MODULES,
        "bias": "none",
    }
    dirs = []
    for n in range(count):
        g = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for module, (fan_in, fan_out) in dims.items():
                part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        out = bench.root / "loras" / f"lora-{n}"
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, out / "adapter_model.safetensors")
        dirs.append(out)
    return make_packages(str(checkpoint), dirs, bench.root / "loras")


# -- transformers ----------------------------------------------------------------------------------


def hf_generate_rate(bench: Bench, model, batch: int, vocab: int, seed: int, static: bool) -> float:
    """transformers `generate`: batch 1 -> decode tokens/s as above; batch > 1 -> generated tokens/s
    with prefill. static: its static cache, `generate` compiling the forward itself."""
    extra = {"cache_implementation": "static"} if static else {}
    ids = torch.tensor(random_prompts(batch, bench.prompt, vocab, seed), device=bench.device)

    @torch.inference_mode()
    def timed(tokens: int) -> float:
        bench.sync()
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
        bench.sync()
        return time.perf_counter() - start

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed(bench.new + 1)  # warm-up (and, static, the compile)
        if batch == 1:
            return bench.new / (timed(bench.new + 1) - timed(1))
        return batch * bench.new / timed(bench.new)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int, device: torch.device) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt], device=device),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


# -- sections --------------------------------------------------------------------------------------


def hbm_bound(bench: Bench) -> None:
    """Bytes read plus written per second by a device-to-device copy of 2 GiB."""
    if bench.smoke:
        bench.record(copy_gb_s=None)
        return
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    bench.record(copy_gb_s=2 * 10 * x.numel() / seconds / 1e9, device_name=torch.cuda.get_device_name())
    del x, y
    torch.cuda.empty_cache()


def parity(bench: Bench) -> None:
    """Greedy tokens of 8 prompts (32 new each) against transformers: float32 identical, bf16 agreement."""
    from libs.engine import SamplingParams

    shape = TINY if bench.smoke else SMOLLM2_135M
    steps, results = 8 if bench.smoke else 32, {}
    prompts = [random_prompts(1, 8 + 5 * i, shape["vocab_size"], 500 + i)[0] for i in range(8)]
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        checkpoint, model, _ = build_checkpoint(bench, f"parity-{name}", shape, dtype, seed=3)
        reference = [hf_greedy(model, p, steps, bench.device) for p in prompts]
        del model
        engine, _ = our_engine(bench, checkpoint, name, 8)
        ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
        results[name] = sum(o.token_ids == r for o, r in zip(ours, reference, strict=True))
        del engine
        release(bench)
    bench.record(parity_float32=f"{results['float32']}/8", parity_bfloat16=f"{results['bfloat16']}/8")
    bench.results["parity_counts"] = results


def kernels(bench: Bench) -> None:
    """Attention alone: our paged kernel against gather + SDPA and dense SDPA (bench/gpu_kernels.py)."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_kernels import attention_timings

    bench.record(**attention_timings(bench.device, bench.smoke))


def one_b(bench: Bench) -> None:
    """The 1.17 B shape: our decode, throughput, busy share, graphs; transformers' eager and compiled."""
    shape = TINY if bench.smoke else LLAMA_1B
    vocab = shape["vocab_size"]
    checkpoint, model, weight_bytes = build_checkpoint(bench, "llama-1b", shape, torch.bfloat16)
    bench.record(weights_1b_gb=weight_bytes / 1e9)
    engine, load_s = our_engine(bench, checkpoint, "bfloat16", max(bench.wide))
    graphs = engine.runner.graphs
    bench.record(
        load_1b_s=load_s,
        kernels=engine.kernels,
        graph_capture_s=None if graphs is None else graphs.capture_seconds,
        graph_memory_mib=None if graphs is None else graphs.capture_bytes / 2**20,
        graph_sizes=None if graphs is None else list(graphs.sizes),
    )
    bench.record(decode_1b_tok_s=our_decode_rate(bench, engine, vocab, 1))
    for n in bench.wide:
        bench.record(**{f"throughput_{n}_tok_s": our_throughput(bench, engine, n, vocab, 10 + n)})
    if not bench.smoke:
        bench.record(busy_64=busy_share(bench, engine, 64, vocab))
    bench.checkpoint_1b, bench.hf_1b = checkpoint, model
    del engine
    release(bench)


def eager_peer(bench: Bench) -> None:
    """transformers `generate`, eager, on the 1.17 B shape."""
    model, vocab = bench.hf_1b, (TINY if bench.smoke else LLAMA_1B)["vocab_size"]
    bench.record(hf_eager_decode_tok_s=hf_generate_rate(bench, model, 1, vocab, 1, static=False))
    bench.record(hf_eager_64_tok_s=hf_generate_rate(bench, model, bench.wide[0], vocab, 2, static=False))


def compiled_peer(bench: Bench) -> None:
    """transformers `generate` with its static cache under torch.compile, on the 1.17 B shape (its
    compiles, for batch 1 and for 64, are in `hf_compiled_seconds`)."""
    model, vocab = bench.hf_1b, (TINY if bench.smoke else LLAMA_1B)["vocab_size"]
    started = time.monotonic()
    bench.record(hf_compiled_decode_tok_s=hf_generate_rate(bench, model, 1, vocab, 1, static=True))
    bench.record(hf_compiled_64_tok_s=hf_generate_rate(bench, model, bench.wide[0], vocab, 2, static=True))
    bench.record(hf_compiled_seconds=time.monotonic() - started)


def release(bench: Bench) -> None:
    """Free what the caller just dropped (`del`), GPU memory included: an engine holds reference cycles."""
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def loras(bench: Bench) -> None:
    """32 requests with 32 distinct rank-8 LoRAs against the same 32 without experts (1.17 B shape)."""
    shape = TINY if bench.smoke else LLAMA_1B
    checkpoint = bench.checkpoint_1b or build_checkpoint(bench, "llama-1b", shape, torch.bfloat16)[0]
    packages, trusted = lora_packages(bench, checkpoint, shape, bench.loras, 8)
    engine, _ = our_engine(bench, checkpoint, "bfloat16", bench.loras)
    names = [engine.load_expert(p, trusted)[0] for p in packages]
    experts = [[(name, 1.0)] for name in names]
    vocab = shape["vocab_size"]
    our_throughput(bench, engine, bench.loras, vocab, 70, experts)  # warm-up: residency, graph capture
    base, lora = [], []
    for i in range(2):  # alternated, so drift hits both alike
        base.append(our_throughput(bench, engine, bench.loras, vocab, 80 + i))
        lora.append(our_throughput(bench, engine, bench.loras, vocab, 80 + i, experts))
    bench.record(base_32_tok_s=max(base), lora_32_tok_s=max(lora))
    del engine
    release(bench)


def eight_b(bench: Bench) -> None:
    """Llama-3-8B's shape: batch-1 decode in bfloat16 against the HBM bound (and that float16 runs)."""
    shape = TINY if bench.smoke else LLAMA_8B
    checkpoint, model, weight_bytes = build_checkpoint(bench, "llama-8b", shape, torch.bfloat16)
    del model
    release(bench)
    engine, load_s = our_engine(bench, checkpoint, "bfloat16", 1)
    bench.record(weights_8b_gb=weight_bytes / 1e9, load_8b_s=load_s)
    bench.record(decode_8b_tok_s=our_decode_rate(bench, engine, shape["vocab_size"], 5))
    del engine
    release(bench)
    engine, _ = our_engine(bench, checkpoint, "float16", 1)
    bench.record(float16_8b_runs=len(engine.generate([[5, 6, 7]])[0].token_ids) > 0)
    del engine
    release(bench)


# -- the table -------------------------------------------------------------------------------------


def table(bench: Bench) -> list[tuple[str, str, str, str]]:
    """(figure, ours, peer or bound, ratio and target) rows from the results."""
    r = bench.results
    bandwidth = r.get("copy_gb_s")
    rows = []

    def ratio(a, b) -> float | None:
        return a / b if isinstance(a, float | int) and isinstance(b, float | int) and b else None

    def row(figure: str, ours, peer_name: str, peer, target: str = "") -> None:
        q = ratio(ours, peer)
        rows.append((figure, _fmt(ours), f"{peer_name} {_fmt(peer)}", (f"{q:.2f}x " if q else "") + target))

    for size in ("1b", "8b"):
        weights = r.get(f"weights_{size}_gb")
        bound = bandwidth / weights if bandwidth and weights else None
        target = TARGETS[f"decode_{size}_vs_bound"]
        row(
            f"{size.upper()} batch-1 decode tok/s",
            r.get(f"decode_{size}_tok_s"),
            "HBM bound",
            bound,
            f"(target {target:.2f}x)",
        )
    row(
        "1B batch-1 decode tok/s",
        r.get("decode_1b_tok_s"),
        "transformers eager",
        r.get("hf_eager_decode_tok_s"),
    )
    row(
        "1B batch-1 decode tok/s",
        r.get("decode_1b_tok_s"),
        "transformers compiled",
        r.get("hf_compiled_decode_tok_s"),
    )
    w = bench.wide
    row(
        f"1B {w[0]}-way tok/s",
        r.get(f"throughput_{w[0]}_tok_s"),
        "transformers eager",
        r.get("hf_eager_64_tok_s"),
    )
    row(
        f"1B {w[0]}-way tok/s",
        r.get(f"throughput_{w[0]}_tok_s"),
        "transformers compiled",
        r.get("hf_compiled_64_tok_s"),
    )
    row(f"1B {w[1]}-way tok/s", r.get(f"throughput_{w[1]}_tok_s"), "", None)
    row(
        "1B 32 LoRAs tok/s",
        r.get("lora_32_tok_s"),
        "no experts",
        r.get("base_32_tok_s"),
        f"(target {TARGETS['lora_vs_base']:.2f}x)",
    )
    row("GPU busy, 64-way decode", r.get("busy_64"), "", None, f"(target {TARGETS['busy_64']:.2f})")
    row("graph capture s / MiB", r.get("graph_capture_s"), "MiB", r.get("graph_memory_mib"))
    for case in ("decode", "chunk"):
        ours = r.get(f"attn_{case}_ours_us")
        row(f"attention {case} us", ours, "gather+SDPA", r.get(f"attn_{case}_gather_sdpa_us"))
        row(f"attention {case} us", ours, "dense SDPA", r.get(f"attn_{case}_dense_sdpa_us"))
    rows.append(
        (
            "parity float32 / bfloat16",
            str(r.get("parity_float32")),
            str(r.get("parity_bfloat16")),
            "(targets 8/8, >= 7/8)",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument(
        "--skip",
        default="",
        type=lambda s: set(filter(None, s.split(","))),
        help="what to leave out, comma-separated: parity, kernels, 1b, loras, 8b, eager, compiled",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(2)
    elif not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device (use --smoke to check the script on a CPU)")
    bench = Bench(args)
    print(f"gpu bench: {torch.__version__}, device {bench.device}, scratch {bench.root}", flush=True)
    # Our figures first, the peers last: the compiled peer's compiles take the longest.
    bench.section("bound", lambda: hbm_bound(bench))
    bench.section("parity", lambda: parity(bench))
    bench.section("kernels", lambda: kernels(bench))
    bench.section("1b", lambda: one_b(bench))
    bench.section("loras", lambda: loras(bench))
    bench.section("8b", lambda: eight_b(bench))
    if bench.hf_1b is not None:
        bench.section("eager", lambda: eager_peer(bench))
        if not bench.smoke:
            bench.section("compiled", lambda: compiled_peer(bench))
    bench.results["seconds"] = time.monotonic() - bench.started
    bench.save()

    rows = table(bench)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for r in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)))
    if bench.results["errors"]:
        print("\nerrors:", json.dumps(bench.results["errors"], indent=2))
    print(f"\n{bench.results['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
