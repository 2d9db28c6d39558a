"""Reads a checkpoint's safetensors weights by name, checking every tensor against the config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from libs.engine.models.config import CheckpointError, ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for every tensor the model needs."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h),
            p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (config.q_size,),
                p + "self_attn.k_proj.bias": (config.kv_size,),
                p + "self_attn.v_proj.bias": (config.kv_size,),
            }
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            shapes |= {
                p + "mlp.gate_proj.bias": (i,),
                p + "mlp.up_proj.bias": (i,),
                p + "mlp.down_proj.bias": (h,),
            }
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index if there is one, else from every file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        located = {name: directory / file for name, file in weight_map.items()}
        for file in set(located.values()):
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (listed in {index.name})")
        return located
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    located = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            located |= {name: file for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return located


def load_weights(directory: str | Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor `expected_shapes` names, as `dtype` on the CPU; clear errors for what is wrong."""
    directory = Path(directory)
    shapes = expected_shapes(config)
    located = _tensor_files(directory)
    missing = [name for name in shapes if name not in located]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory}: tensor {missing[0]!r} is missing{more}")
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(located[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != shapes[name]:
                    raise CheckpointError(
                        f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the config implies {shapes[name]}"
                    )
                weights[name] = tensor.to(dtype)
    return weights
