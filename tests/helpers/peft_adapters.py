"""Tiny PEFT adapters saved by `peft` itself on a tiny checkpoint (see `tiny_checkpoint.py`).

Every function loads the base model with transformers, wraps it with `peft`, gives the adapter
non-trivial weights (a fresh LoRA's B is zero and a fresh IA³ vector is all ones, which would hide
mistakes) and saves it with `save_pretrained`, returning the saved directory.
"""

from __future__ import annotations

import warnings
from pathlib import Path

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: tuple[str, ...] = LORA_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """A LoRA with random A and B (`init_lora_weights=False`) on `target_modules` of every layer."""
    from peft import LoraConfig

    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    return _save(base_dir, out_dir, config, seed)


def write_ia3_adapter(base_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """An IA³ adapter on PEFT's default Llama modules (k_proj, v_proj, down_proj as feed-forward),
    with its scaling vectors drawn from U(0.5, 1.5) instead of PEFT's all-ones start."""
    import torch
    from peft import IA3Config

    def randomize(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "ia3_l" in name:
                    param.uniform_(0.5, 1.5)

    return _save(base_dir, out_dir, IA3Config(task_type="CAUSAL_LM"), seed, randomize)


def write_prompt_tuning_adapter(
    base_dir: Path, out_dir: Path, *, num_virtual_tokens: int = 5, seed: int = 0
) -> Path:
    """A soft prompt of `num_virtual_tokens` randomly initialized embeddings."""
    from peft import PromptTuningConfig

    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens)
    return _save(base_dir, out_dir, config, seed)


def write_all_adapters(base_dir: Path, root: Path, *, seed: int = 0) -> dict[str, Path]:
    """One adapter of each kind under `root`, by the manifest's adapter_type."""
    return {
        "lora": write_lora_adapter(base_dir, root / "lora", seed=seed),
        "ia3": write_ia3_adapter(base_dir, root / "ia3", seed=seed),
        "soft_prompt": write_prompt_tuning_adapter(base_dir, root / "soft_prompt", seed=seed),
    }


def _save(base_dir: Path, out_dir: Path, config, seed: int, adjust=None) -> Path:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # peft 0.21 calls a transformers method that transformers 5 deprecates; not ours to fix.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    if adjust is not None:
        adjust(model)
    model.save_pretrained(out_dir)
    return out_dir
