"""The engine on one GPU against its bound and its peers, in one run sized for one device call.

Random-weight Llamas of real shapes (bench/gpu_models.py; nothing from a model hub): SmolLM2-135M's
for parity, Llama-3.2-1B's with a 49,152-token vocabulary (1.07 B parameters), Llama-3-8B's (8.03 B).
One table, with:

- parity: float32 greedy tokens against transformers (identical), and bfloat16 agreement;
- attention alone: our paged kernel against gather + SDPA and dense SDPA (bench/gpu_kernels.py);
- batch-1 decode of the 1.07 B and 8.03 B shapes against the HBM bound (weight bytes over the
  bandwidth of a device copy measured here, bytes read plus written), decode-graph capture time
  and memory;
- 64-way and 256-way throughput (128-token prompts, 128 new tokens);
- the share of a 64-way decode's wall time in which the GPU runs a kernel, a copy or a memset
  (the profiler trace's device activity only, overlaps merged);
- 32 requests with 32 distinct LoRAs (rank 8, all seven projections) against the same 32 without;
- transformers `generate` eager on the 1.07 B shape, in the same run.

Extras, each behind its flag: `--fp16` runs the 8.03 B shape in float16 too; `--compiled` adds
transformers with its static cache under `torch.compile` (two compiles, batch 1 and 64: minutes).
Decode rates are (time of 129 new tokens - time of 1) / 128, so prefill is left out alike for every
engine.

Each section runs guarded: a failure is recorded, its rows in the table say why, and the rest goes
on; `--budget S` leaves out the sections not begun S seconds into the run, and SIGINT or SIGTERM
ends the section in progress and prints the table. With $OUT set, $OUT/gpu_bench.json is rewritten
after every section. The table ends with each section's seconds beside its estimated seconds on an
H100 (SECTIONS: estimates from what each section does, not measurements).

    python bench/gpu.py                    # on the GPU machine (docs/engine.md#measuring-it-benchgpupy)
    python bench/gpu.py --fp16 --compiled  # with the extras
    python bench/gpu.py --smoke --fp16     # the whole flow but --compiled on the CPU, tiny shapes,
                                           # Triton's interpreter: checks the script, times sections
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if str(REPO / "bench") not in sys.path:  # run as a script it is there already (first)
    sys.path.append(str(REPO / "bench"))
# The bench's own modules, importable once the path is set (hence E402).
from gpu_engine import busy_share, our_decode_rate, our_engine, our_throughput  # noqa: E402
from gpu_models import (  # noqa: E402
    LLAMA_1B,
    LLAMA_8B,
    SMOLLM2_135M,
    TINY,
    TINY_8B,
    build_hf,
    hf_generate_rate,
    hf_greedy,
    hf_weights,
    lora_packages,
    model_dir,
    num_parameters,
    random_prompts,
    random_weights,
    size_label,
    weight_bytes,
)

TARGETS = {
    "decode_1b_vs_bound": 0.45,
    "decode_8b_vs_bound": 0.70,
    "busy_64": 0.90,
    "lora_vs_base": 0.80,
    "bf16_agreement": 7 / 8,
}
H200_TARGETS = {"decode_1b_tok_s": 800, "throughput_64_tok_s": 7000}


class Unavailable(Exception):
    """A section needs what an earlier section did not leave."""


class Bench:
    """The run's settings, its figures as they come, what sections hand on, and where it is written."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.root = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
        self.figures: dict[str, object] = {}
        self.status: dict[str, str] = {}  # section -> "ok", "failed: ...", "skipped: ...", "not run: ..."
        self.seconds: dict[str, float] = {}
        self.held: dict[str, object] = {}  # what a section leaves for later ones (models, engines)
        self.out = Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT") else None
        self.started = time.monotonic()
        self.interrupted = False
        # Sizes and repeats: real ones on the GPU; on the CPU, where Triton's interpreter runs each
        # program in turn, a few tokens' worth, every path still taken.
        self.prompt = 4 if self.smoke else 128
        self.new = 4 if self.smoke else 128
        self.wide = (2, 4) if self.smoke else (64, 256)
        self.loras = 2 if self.smoke else 32
        self.repeats = 1 if self.smoke else 3  # decode rates: best of
        self.lora_rounds = 1 if self.smoke else 2  # base and LoRA runs, alternated
        self.busy_steps = 4 if self.smoke else 32
        self.small = TINY if self.smoke else SMOLLM2_135M
        self.one_b = TINY if self.smoke else LLAMA_1B
        self.eight_b = TINY_8B if self.smoke else LLAMA_8B

    def run(self, section: Section) -> None:
        """Run one section guarded: a failure is recorded with its reason and the rest still runs."""
        reason = section.left_out(self)
        if reason is None and self.interrupted:
            reason = "not run: interrupted"
        if reason is None and self.args.budget and time.monotonic() - self.started >= self.args.budget:
            reason = f"not run: past the {self.args.budget:.0f} s budget"
        if reason is not None:
            self.status[section.name] = reason
            print(f"-- {section.name}: {reason}", flush=True)
            return
        print(f"-- {section.name} ({time.monotonic() - self.started:.0f} s in)", flush=True)
        began = time.monotonic()
        try:
            section.run(self)
            self.status[section.name] = "ok"
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (main): keep what was measured, print the table
            self.interrupted = True
            self.status[section.name] = "failed: interrupted"
        except Exception as exc:  # a bench keeps going and reports what broke
            if not isinstance(exc, Unavailable):
                traceback.print_exc()
            self.status[section.name] = f"failed: {short(exc)}"
        finally:
            self.seconds[section.name] = time.monotonic() - began
            release(self)
            self.save()
        print(
            f"   {section.name}: {self.status[section.name]}, {self.seconds[section.name]:.1f} s", flush=True
        )

    def record(self, **figures: object) -> None:
        self.figures.update(figures)
        for key, value in figures.items():
            print(f"   {key}: {fmt(value)}", flush=True)

    def need(self, key: str, section: str) -> object:
        """What section `section` left under `key`, or Unavailable saying why it is not there."""
        if key not in self.held:
            raise Unavailable(f"needs section {section} ({self.status.get(section, 'not run')})")
        return self.held[key]

    def drop(self, *keys: str) -> None:
        for key in keys:
            self.held.pop(key, None)
        release(self)

    def save(self) -> None:
        if self.out is None:
            return
        sections = {
            name: {"status": status, "seconds": self.seconds.get(name)}
            for name, status in self.status.items()
        }
        report = {
            "figures": self.figures,
            "sections": sections,
            "seconds": time.monotonic() - self.started,
            "torch": torch.__version__,
        }
        self.out.write_text(json.dumps(report, indent=2, default=str))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def short(exc: BaseException, width: int = 100) -> str:
    """`Type: message`, its first line, at most `width` characters: what a failed row shows."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return text if len(text) <= width else text[: width - 1] + "…"


def fmt(value: object) -> str:
    return f"{value:,.3f}" if isinstance(value, float) else str(value)


def release(bench: Bench) -> None:
    """Free what was just dropped, GPU memory included (an engine holds reference cycles)."""
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


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


def parity(bench: Bench) -> None:
    """Greedy tokens of 8 prompts (32 new each) against transformers: float32 identical, bf16
    agreement. The one section whose engines read a saved checkpoint (135 M: small to save)."""
    from libs.engine import SamplingParams

    shape, steps, counts = bench.small, 4 if bench.smoke else 32, {}
    lengths = [3 + i if bench.smoke else 8 + 5 * i for i in range(8)]
    prompts = [random_prompts(1, n, shape["vocab_size"], 500 + i)[0] for i, n in enumerate(lengths)]
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = build_hf(shape, dtype, bench.device, seed=3)
        checkpoint = model_dir(bench.root / f"parity-{name}", shape, model)
        reference = [hf_greedy(model, p, steps, bench.device) for p in prompts]
        del model
        engine, _ = our_engine(bench, checkpoint, name, 8)
        ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
        counts[name] = sum(o.token_ids == r for o, r in zip(ours, reference, strict=True))
        del engine
        release(bench)
        bench.record(**{f"parity_{name}": f"{counts[name]}/8"})


def attention(bench: Bench) -> None:
    """Attention alone: our paged kernel against gather + SDPA and dense SDPA (bench/gpu_kernels.py)."""
    from gpu_kernels import attention_timings

    bench.record(**attention_timings(bench.device, bench.smoke))


def one_b(bench: Bench) -> None:
    """The 1.07 B shape: transformers' model (the eager peer's), and our engine on its very tensors
    in memory, sized for 256 sequences (its decode graphs); batch-1 decode."""
    shape = bench.one_b
    model = build_hf(shape, torch.bfloat16, bench.device)
    directory = model_dir(bench.root / "llama-1b", shape)
    bench.held |= {"hf_1b": model, "dir_1b": directory}
    bench.record(params_1b=num_parameters(shape), weights_1b_gb=weight_bytes(model) / 1e9)
    engine, start_s = our_engine(bench, directory, "bfloat16", max(bench.wide), weights=hf_weights(model))
    bench.held["engine_1b"] = engine
    graphs = engine.runner.graphs
    bench.record(
        engine_1b_start_s=start_s,
        kernels=engine.kernels,
        graph_capture_s=None if graphs is None else graphs.capture_seconds,
        graph_memory_mib=None if graphs is None else graphs.capture_bytes / 2**20,
        graph_sizes=None if graphs is None else list(graphs.sizes),
    )
    bench.record(decode_1b_tok_s=our_decode_rate(bench, engine, shape["vocab_size"], 1))


def throughput(bench: Bench) -> None:
    """64- and 256-way generated tokens/s on the 1.07 B engine, each after a short warm-up at its
    width (the prefill kernels' first launches at that size)."""
    engine, vocab = bench.need("engine_1b", "1b"), bench.one_b["vocab_size"]
    from libs.engine import SamplingParams

    for n in bench.wide:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.generate(random_prompts(n, bench.prompt, vocab, 20 + n), warm)
        bench.record(**{f"throughput_{n}_tok_s": our_throughput(bench, engine, n, vocab, 10 + n)})


def busy(bench: Bench) -> None:
    """The device-busy share of a 64-way decode on the 1.07 B engine."""
    engine = bench.need("engine_1b", "1b")
    share = busy_share(bench, engine, bench.wide[0], bench.one_b["vocab_size"], bench.busy_steps)
    bench.record(busy_64=share)


def loras(bench: Bench) -> None:
    """32 requests with 32 distinct rank-8 LoRAs against the same 32 without experts, on the
    1.07 B engine, alternated twice (drift hits both alike)."""
    engine, directory = bench.need("engine_1b", "1b"), bench.need("dir_1b", "1b")
    shape, count = bench.one_b, bench.loras
    started = time.monotonic()
    packages, trusted = lora_packages(bench.root / "loras", directory, shape, count, 8)
    names = [engine.load_expert(p, trusted)[0] for p in packages]
    bench.record(lora_setup_s=time.monotonic() - started)
    experts = [[(name, 1.0)] for name in names]
    vocab = shape["vocab_size"]
    our_throughput(bench, engine, count, vocab, 70, experts)  # warm-up: residency, graph capture
    base, lora = [], []
    for i in range(bench.lora_rounds):
        base.append(our_throughput(bench, engine, count, vocab, 80 + i))
        lora.append(our_throughput(bench, engine, count, vocab, 80 + i, experts))
    bench.record(base_32_tok_s=max(base), lora_32_tok_s=max(lora))


def eight_b(bench: Bench, dtype: str = "bfloat16", suffix: str = "") -> None:
    """Llama-3-8B's shape: batch-1 decode against the HBM bound. Its weights are drawn on the GPU
    straight into our engine (gpu_models.random_weights): nothing is saved or read."""
    bench.drop("engine_1b")  # done with (throughput, busy, loras): its KV cache and graphs go
    shape = bench.eight_b
    directory = bench.held.get("dir_8b") or model_dir(bench.root / "llama-8b", shape)
    bench.held["dir_8b"] = directory
    weights = random_weights(bench.device, seed=5)
    engine, start_s = our_engine(bench, directory, dtype, 1, weights=weights)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    bench.record(
        **{
            "params_8b": num_parameters(shape),
            "weights_8b_gb": num_parameters(shape) * element / 1e9,
            f"engine_8b{suffix}_start_s": start_s,
            f"decode_8b{suffix}_tok_s": our_decode_rate(bench, engine, shape["vocab_size"], 5),
        }
    )


def eager_peer(bench: Bench) -> None:
    """transformers `generate`, eager, on the 1.07 B model: batch-1 decode and 64-way."""
    model = bench.need("hf_1b", "1b")
    run = dict(prompt_len=bench.prompt, new=bench.new, vocab=bench.one_b["vocab_size"], device=bench.device)
    bench.record(hf_eager_decode_tok_s=hf_generate_rate(model, 1, seed=1, static=False, **run))
    bench.record(hf_eager_64_tok_s=hf_generate_rate(model, bench.wide[0], seed=2, static=False, **run))


def compiled_peer(bench: Bench) -> None:
    """transformers `generate` with its static cache under torch.compile, on the 1.07 B model (its
    compiles, batch 1 and 64, are in `hf_compiled_seconds`)."""
    model = bench.need("hf_1b", "1b")
    run = dict(prompt_len=bench.prompt, new=bench.new, vocab=bench.one_b["vocab_size"], device=bench.device)
    started = time.monotonic()
    bench.record(hf_compiled_decode_tok_s=hf_generate_rate(model, 1, seed=1, static=True, **run))
    bench.record(hf_compiled_64_tok_s=hf_generate_rate(model, bench.wide[0], seed=2, static=True, **run))
    bench.record(hf_compiled_seconds=time.monotonic() - started)


@dataclass(frozen=True)
class Section:
    """One guarded part of the run. estimate_s: seconds it should take on an H100, worked out from
    what it does (no GPU has run it yet): an estimate to plan the device call with, not a figure."""

    name: str
    run: Callable[[Bench], None]
    estimate_s: int
    flag: str | None = None  # run only with --<flag>

    def left_out(self, bench: Bench) -> str | None:
        if self.flag and not getattr(bench.args, self.flag):
            return f"skipped: add --{self.flag}"
        if self.flag == "compiled" and bench.smoke:
            return "skipped: not with --smoke (torch.compile on the CPU takes minutes)"
        if self.name in bench.args.skip:
            return "skipped: --skip"
        return None


# In order: the figures first, the eager peer (least needed) last of the default run.
# Estimates, H100 (bf16 ~800 TFLOP/s, device copy ~3.0 TB/s read plus written); Triton's JIT
# compiles on a fresh machine (about 1-2 s per kernel variant, fewer after the kernel tests have
# filled its cache) weigh more than the measured work in most sections. Python, torch, transformers
# and the engine take about 15 s to import before the first section: about 170 s in all.
SECTIONS = (
    # 2 GiB copied 13 times: milliseconds; the CUDA context's start.
    Section("bound", hbm_bound, 3),
    # Two 135 M models built and saved (0.8 GB), transformers' 2 x 256 greedy tokens eager at ~20 ms
    # (30 layers, launch-bound), two engines loading them, graphs for 1-8 captured, float32 and
    # bfloat16 kernel variants compiled (~25 s of it).
    Section("parity", parity, 45),
    # Two cases x three kernels x 21 runs: milliseconds; the kernel's compiles for the two cases.
    Section("attention", attention, 10),
    # transformers builds 2.1 GB on the GPU (~3 s); the engine fuses the same tensors in memory and
    # captures 13 decode graphs (~5 s with their compiles, some shared with parity's bfloat16);
    # ~520 decoded tokens at ~1.5 ms.
    Section("1b", one_b, 25),
    # 8 k + 33 k prefill tokens (~0.1 s), 128 decode steps at 64 (~4 ms) and 256 (~10 ms), warm-ups.
    Section("throughput", throughput, 6),
    # 64 prefills, 40 steps, the profiler's start, stop and trace export.
    Section("busy", busy, 5),
    # 32 adapters of 22.5 MB (float32) drawn, saved, packaged and signed, then verified and loaded:
    # ~20 s of CPU; 5 runs of 32 x 128 tokens; the LoRA kernels' compiles, expert graphs captured.
    Section("loras", loras, 30),
    # 16 GB drawn on the GPU (~0.1 s), the engine's start and one graph with the head-dim-128
    # kernel variants compiled (~10 s), ~520 decoded tokens at ~7 ms (70 % of a ~190 tok/s bound).
    Section("8b", eight_b, 20),
    # transformers eager: 8 + 129 + 1 tokens at batch 1 and 8 + 128 at 64, ~15 ms each (launch-bound).
    Section("eager", eager_peer, 10),
    # As 8b in float16: its kernel variants compiled again.
    Section("fp16", lambda bench: eight_b(bench, "float16", "_fp16"), 20, flag="fp16"),
    # Two torch.compile runs of the forward (batch 1 and 64), 1-2 minutes each, then the runs.
    Section("compiled", compiled_peer, 240, flag="compiled"),
)


# -- the table -------------------------------------------------------------------------------------


def table(bench: Bench) -> list[tuple[str, str, str, str]]:
    """(figure, ours, peer or bound, ratio and target) rows; a row whose section did not run or
    failed says why instead."""
    r = bench.figures
    rows: list[tuple[str, str, str, str]] = []

    def ratio(a, b) -> float | None:
        return a / b if isinstance(a, float | int) and isinstance(b, float | int) and b else None

    def row(sections: tuple[str, ...], figure: str, ours, peer_name: str, peer, target: str = "") -> None:
        missing = next((s for s in sections if bench.status.get(s, "not run") != "ok"), None)
        if missing is not None:
            rows.append((figure, "-", f"{missing}: {bench.status.get(missing, 'not run')}", ""))
            return
        q = ratio(ours, peer)
        peer_text = f"{peer_name} {fmt(peer)}" if peer_name else ""
        rows.append((figure, fmt(ours), peer_text, (f"{q:.2f}x " if q else "") + target))

    on_h200 = "H200" in str(r.get("device_name", ""))
    label_1b, label_8b = size_label(bench.one_b), size_label(bench.eight_b)
    row(("bound",), "device copy GB/s (read + written)", r.get("copy_gb_s"), "", None)
    for size, label in (("1b", label_1b), ("8b", label_8b)):
        weights, bandwidth = r.get(f"weights_{size}_gb"), r.get("copy_gb_s")
        bound = bandwidth / weights if bandwidth and weights else None
        target = f"(target {TARGETS[f'decode_{size}_vs_bound']:.2f}x)"
        if size == "1b" and on_h200:
            target += f" (H200 target {H200_TARGETS['decode_1b_tok_s']})"
        row(
            (size, "bound"),
            f"{label} batch-1 decode tok/s",
            r.get(f"decode_{size}_tok_s"),
            "HBM bound",
            bound,
            target,
        )
    if "fp16" in bench.status and not bench.status["fp16"].startswith("skipped"):
        row(("fp16",), f"{label_8b} batch-1 decode tok/s, float16", r.get("decode_8b_fp16_tok_s"), "", None)
    row(
        ("1b", "eager"),
        f"{label_1b} batch-1 decode tok/s",
        r.get("decode_1b_tok_s"),
        "transformers eager",
        r.get("hf_eager_decode_tok_s"),
    )
    w = bench.wide
    target_64 = f"(H200 target {H200_TARGETS['throughput_64_tok_s']})" if on_h200 else ""
    row(
        ("throughput", "eager"),
        f"{label_1b} {w[0]}-way tok/s",
        r.get(f"throughput_{w[0]}_tok_s"),
        "transformers eager",
        r.get("hf_eager_64_tok_s"),
        target_64,
    )
    if bench.args.compiled:
        row(
            ("1b", "compiled"),
            f"{label_1b} batch-1 decode tok/s",
            r.get("decode_1b_tok_s"),
            "transformers compiled",
            r.get("hf_compiled_decode_tok_s"),
        )
        row(
            ("throughput", "compiled"),
            f"{label_1b} {w[0]}-way tok/s",
            r.get(f"throughput_{w[0]}_tok_s"),
            "transformers compiled",
            r.get("hf_compiled_64_tok_s"),
        )
    row(("throughput",), f"{label_1b} {w[1]}-way tok/s", r.get(f"throughput_{w[1]}_tok_s"), "", None)
    row(
        ("loras",),
        f"{label_1b} {bench.loras} LoRAs tok/s",
        r.get("lora_32_tok_s"),
        "no experts",
        r.get("base_32_tok_s"),
        f"(target {TARGETS['lora_vs_base']:.2f}x)",
    )
    row(
        ("busy",),
        f"GPU busy, {w[0]}-way decode",
        r.get("busy_64"),
        "",
        None,
        f"(target {TARGETS['busy_64']:.2f})",
    )
    row(("1b",), "graph capture s / MiB", r.get("graph_capture_s"), "MiB", r.get("graph_memory_mib"))
    for case in ("decode", "chunk"):
        ours = r.get(f"attn_{case}_ours_us")
        row(("attention",), f"attention {case} us", ours, "gather+SDPA", r.get(f"attn_{case}_gather_sdpa_us"))
        row(("attention",), f"attention {case} us", ours, "dense SDPA", r.get(f"attn_{case}_dense_sdpa_us"))
    row(
        ("parity",),
        "parity: float32 (ours) / bfloat16",
        r.get("parity_float32"),
        "bfloat16",
        r.get("parity_bfloat16"),
        "(targets 8/8, >= 7/8)",
    )
    return rows


def print_report(bench: Bench) -> None:
    rows = [("figure", "ours", "peer or bound", "ratio"), *table(bench)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    where = "the CPU, --smoke" if bench.smoke else str(bench.figures.get("device_name", "the GPU"))
    print(f"\n{'section':<11} {'seconds':>7}  {'H100 estimate':>13}  status (seconds measured on {where})")
    for section in SECTIONS:
        seconds = bench.seconds.get(section.name)
        took = "-" if seconds is None else f"{seconds:.1f}"
        status = bench.status.get(section.name, "not run")
        print(f"{section.name:<11} {took:>7}  {section.estimate_s:>13}  {status}")
    print(f"\n{time.monotonic() - bench.started:.0f} s in all")


def _as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--fp16", action="store_true", help="also run the 8.03 B shape in float16")
    parser.add_argument(
        "--compiled", action="store_true", help="also run transformers under torch.compile (minutes)"
    )
    parser.add_argument(
        "--skip",
        default="",
        type=lambda s: set(filter(None, s.split(","))),
        help="sections to leave out, comma-separated: " + ", ".join(s.name for s in SECTIONS),
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds after which no further section begins"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(2)
    elif not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device (use --smoke to check the script on a CPU)")
    signal.signal(signal.SIGTERM, _as_interrupt)  # `timeout` sends it: the table is still printed
    bench = Bench(args)
    print(f"gpu bench: torch {torch.__version__}, device {bench.device}, scratch {bench.root}", flush=True)
    bench.save()
    for section in SECTIONS:
        try:
            bench.run(section)
        except KeyboardInterrupt:  # between sections: the rest are left out, the table printed
            bench.interrupted = True
    bench.save()
    print_report(bench)
    shutil.rmtree(bench.root, ignore_errors=True)  # checkpoints and packages: gigabytes on the GPU machine


if __name__ == "__main__":
    main()
