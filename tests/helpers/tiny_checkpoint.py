"""Tiny but real HF checkpoints, generated on the spot: a trained byte-level BPE tokenizer with a
chat template, and random Llama / Qwen2 / Qwen3 weights saved by transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.tokenizer_fixtures import train_byte_level_bpe

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(directory: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE with ChatML special tokens, write the tokenizer files, return the vocab size."""
    tok = train_byte_level_bpe(vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )
    return tok.get_vocab_size()


ARCHITECTURES = ("llama", "qwen2", "qwen3")


def write_checkpoint(
    directory: Path,
    architecture: str = "llama",
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_parameters: dict | None = None,
    init_std: float = 0.08,
) -> Path:
    """Random weights for `architecture` saved by transformers, plus the tiny tokenizer."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    vocab_size = write_tokenizer(directory)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[architecture]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=init_std,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Random norms and biases too, so that a wrong use of them shows in the outputs.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, init_std)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory
