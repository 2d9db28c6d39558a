"""Draft checkpoints for speculative decoding tests, written by transformers itself.

`write_noisy_draft`: the target's weights plus Gaussian noise, so that the draft's distribution is
near the target's but not equal to it (drafts are often, not always, accepted: both branches of
the rejection rule run). `write_tiny_draft`: a tiny random Llama with another checkpoint's
tokenizer files and vocabulary size (a drafter for the default model that costs nothing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _copy_tokenizer(source: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)


def write_noisy_draft(target: Path, out_dir: Path, *, noise: float = 0.5, seed: int = 0) -> Path:
    """The target with every weight w replaced by w + noise * std(w) * N(0, 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            scale = param.std() if param.numel() > 1 else param.abs()
            param.add_(noise * scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out_dir)
    _copy_tokenizer(target, out_dir)
    return out_dir


def write_tiny_draft(tokenizer_source: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """A one-layer random Llama sharing `tokenizer_source`'s tokenizer and vocabulary size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = json.loads((tokenizer_source / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=source["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=source.get("max_position_embeddings", 2048),
        tie_word_embeddings=True,
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(out_dir)
    _copy_tokenizer(tokenizer_source, out_dir)
    return out_dir
