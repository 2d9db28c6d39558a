"""Multi-LoRA serving throughput on the default model, measured in one run.

32 concurrent requests, each with a different rank-8 LoRA (on q/k/v/o/gate/up/down), against the
same 32 requests with no expert, and against `peft` serving them the way it can: one adapter
active at a time, the requests of that adapter batched together (here one request per adapter).
peft's throughput does not depend on how many adapters there are (it runs them one after the
other), so it is measured on the first --peft-adapters of them.

    python bench/adapters.py --model data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TARGETS = {"vs_no_expert": 0.75, "vs_peft": 10.0}
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT LoRA directories: one saved by peft, the others with the same layout and fresh
    random weights (a model load per adapter would dominate the setup)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(
            root / "lora-0"
        )
    template = load_file(root / "lora-0" / "adapter_model.safetensors")
    dirs = [root / "lora-0"]
    for i in range(1, count):
        out = root / f"lora-{i}"
        out.mkdir()
        (out / "adapter_config.json").write_text((root / "lora-0" / "adapter_config.json").read_text())
        g = torch.Generator().manual_seed(i)
        save_file(
            {k: torch.randn(v.shape, generator=g) * v.std() for k, v in template.items()},
            out / "adapter_model.safetensors",
        )
        dirs.append(out)
    return dirs


def make_packages(model_dir: str, dirs: list[Path], root: Path) -> tuple[list[Path], Path]:
    """Signed .expert packages of the adapters, and the trusted-keys directory that verifies them."""
    from libs.experts.manifest import BaseModelIdentity, Manifest
    from libs.experts.package import build_package, write_package
    from libs.experts.peft_adapter import read_peft_adapter
    from libs.experts.signing import generate_keypair, load_private_key

    private, public = generate_keypair(root / "keys")
    trusted = root / "trusted"
    trusted.mkdir()
    (trusted / "bench.pub").write_bytes(public.read_bytes())
    key = load_private_key(private)
    identity = BaseModelIdentity.from_dir(model_dir)
    packages = []
    for i, d in enumerate(dirs):
        adapter = read_peft_adapter(d)
        manifest = Manifest(
            name=f"bench-lora-{i}",
            version="1.0.0",
            description=f"benchmark LoRA {i}",
            adapter_type="lora",
            base_model=identity,
            target_modules=adapter.target_modules,
            rank=adapter.rank,
            alpha=adapter.alpha,
        )
        packages.append(
            write_package(
                root / f"bench-lora-{i}.expert", build_package(manifest, adapter.config, adapter.weights, key)
            )
        )
    return packages, trusted


def ours(
    model_dir: str,
    packages: list[Path],
    trusted: Path,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
) -> dict[str, float]:
    from libs.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
    )
    names = [engine.load_expert(p, trusted)[0] for p in packages]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(
        prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), experts=[[(names[0], 1.0)], None]
    )

    def run(experts: list | None) -> float:
        start = time.perf_counter()
        outs = engine.generate(prompts, params, experts=experts)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    plain, lora = [], []
    for _ in range(repeats):  # alternate, so that machine noise hits both alike
        plain.append(run(None))
        lora.append(run([[(name, 1.0)] for name in names]))
    stats = engine.get_stats().experts
    return {
        "plain": max(plain),
        "lora": max(lora),
        "resident": stats.experts_resident,
        "device_mb": stats.device_bytes / 2**20,
    }


def peft_serving(model_dir: str, dirs: list[Path], prompts: list[list[int]], new_tokens: int) -> float:
    """One adapter active at a time, its requests batched: tokens per second."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), dirs[0], adapter_name="a0"
        )
        for i, d in enumerate(dirs[1:], start=1):
            model.load_adapter(d, adapter_name=f"a{i}")
    model.eval()

    @torch.inference_mode()
    def generate(prompt: list[int], tokens: int) -> None:
        ids = torch.tensor([prompt])
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )

    model.set_adapter("a0")
    generate(prompts[0], 4)  # warm up
    start = time.perf_counter()
    for i, prompt in enumerate(prompts[: len(dirs)]):
        model.set_adapter(f"a{i}")
        generate(prompt, new_tokens)
    return len(dirs) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--peft-adapters", type=int, default=6, help="adapters peft is measured on")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = make_adapters(args.model, root / "peft", args.requests, args.rank)
        packages, trusted = make_packages(args.model, dirs, root)
        us = ours(args.model, packages, trusted, prompts, args.new_tokens, args.repeats)
        peft_rate = peft_serving(args.model, dirs[: args.peft_adapters], prompts, args.new_tokens)

    print(
        f"\nmulti-LoRA throughput, {args.model}, fp32, CPU, {args.threads} threads: "
        f"{args.requests} requests, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
        f"rank-{args.rank} LoRA on {len(MODULES)} projections"
    )
    print(f"experts resident on the device tier: {us['resident']} ({us['device_mb']:.0f} MiB)")
    print(f"{'no expert':<48}{us['plain']:>9.1f} tok/s")
    print(f"{f'{args.requests} requests, {args.requests} different LoRAs':<48}{us['lora']:>9.1f} tok/s")
    print(f"{f'peft, one adapter at a time ({args.peft_adapters} measured)':<48}{peft_rate:>9.1f} tok/s")
    checks = [
        ("LoRAs / no expert", us["lora"] / us["plain"], TARGETS["vs_no_expert"]),
        ("LoRAs / peft", us["lora"] / peft_rate, TARGETS["vs_peft"]),
    ]
    for name, ratio, target in checks:
        print(
            f"{name:<24}{ratio:>8.2f}x   target >= {target:.2f}x   {'PASS' if ratio >= target else 'short'}"
        )


if __name__ == "__main__":
    main()
