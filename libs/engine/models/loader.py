"""Reads a checkpoint's safetensors weights by name, checking every tensor against the config.

With a quantization, each linear weight and the LM head is quantized as it is read, one tensor at a
time, so the float32 checkpoint is never in memory whole. A checkpoint stored quantized
(`ModelConfig.stored_quantized`) may keep, for a weight `X.weight`, its codes `X.qweight` (int8,
or uint8 holding two int4 nibbles), float16 `X.scales` and, for int4, float16 `X.mins`, in the
row layout of libs/engine/quant.py; those are read as they are. Its other weights are float.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from libs.engine import quant
from libs.engine.models.config import CheckpointError, ModelConfig, is_quantizable
from libs.engine.quant import QuantizedWeight


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


def quantizable_names(config: ModelConfig) -> set[str]:
    """The weights a quantization applies to (`is_quantizable`)."""
    return {name for name in expected_shapes(config) if is_quantizable(name, config.tie_word_embeddings)}


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


def load_weights(
    directory: str | Path, config: ModelConfig, dtype: torch.dtype, quantization: str | None = None
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor `expected_shapes` names, as `dtype` on the CPU, or as a QuantizedWeight where the
    checkpoint stores one or `quantization` ("int8", "int4") asks for one; clear errors for what
    is wrong."""
    directory = Path(directory)
    shapes = expected_shapes(config)
    quantized = quantizable_names(config)
    if config.stored_quantized and quantization is not None:
        raise CheckpointError(
            f"{directory}: the checkpoint's weights are stored quantized and are served as they are; "
            f"quantization {quantization!r} cannot apply to them (leave it unset)"
        )
    located = _tensor_files(directory)
    # Stored quantized: the weights whose codes are in the checkpoint.
    kept = {
        name
        for name in quantized
        if config.stored_quantized and name.removesuffix("weight") + "qweight" in located
    }
    by_file = _by_file(directory, shapes, kept, located)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                if name in kept:
                    weights[name] = _stored_quantized(f, file, name, shapes[name], located)
                else:
                    weights[name] = _float_weight(
                        f, file, name, shapes[name], dtype, quantization if name in quantized else None
                    )
    return weights


def _stored_names(name: str, kept: set[str]) -> list[str]:
    """The tensors that hold the weight `name` in the checkpoint: its codes and scales when `kept`
    (stored quantized), else itself."""
    if name in kept:
        return [name.removesuffix("weight") + part for part in ("qweight", "scales")]
    return [name]


def _by_file(
    directory: Path, shapes: dict[str, tuple[int, ...]], kept: set[str], located: dict[str, Path]
) -> dict[Path, list[str]]:
    """The weights to read, grouped by the file that holds them; refused when one is missing."""
    missing = [stored for name in shapes for stored in _stored_names(name, kept) if stored not in located]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory}: tensor {missing[0]!r} is missing{more}")
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(located[_stored_names(name, kept)[0]], []).append(name)
    return by_file


def _float_weight(
    f: object, file: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype, quantization: str | None
) -> torch.Tensor | QuantizedWeight:
    """The stored float weight `name`, checked against `shape`: as `dtype`, or quantized at load
    when `quantization` is given."""
    tensor = f.get_tensor(name)  # type: ignore[attr-defined]
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}"
        )
    if quantization is not None:
        return _quantize_at_load(tensor, quantization, lm_head=not name.endswith("_proj.weight"))
    # A copy: safetensors maps the file, and a tensor still viewing the mapping would keep every
    # page the load touched resident.
    return tensor.to(dtype, copy=True)


def _quantize_at_load(weight: torch.Tensor, quantization: str, lm_head: bool) -> QuantizedWeight:
    """Projections: int8 per output channel, or int4 in groups of 32 with a minimum. The LM head
    (the embedding table too, when tied) in int8 groups of 32, GGUF's Q8_0, in both modes, as
    llama.cpp's quantized files keep it: it is the weight that loses the most to coarser steps
    (perplexity in docs/engine.md#quantized-weights)."""
    if lm_head:
        return quant.quantize(weight, "int8", quant.GGUF_GROUP)
    return quant.quantize(weight, quantization)


def _stored_quantized(
    f: object, file: Path, name: str, shape: tuple[int, ...], located: dict[str, Path]
) -> QuantizedWeight:
    """The weight `name` from its stored codes, scales and minimums, checked against `shape`."""
    base = name.removesuffix("weight")

    def get(part: str) -> torch.Tensor:
        if located.get(base + part, file) != file:
            raise CheckpointError(f"{file.name}: {base + part!r} must be in the same file as {base}qweight")
        return f.get_tensor(base + part)  # type: ignore[attr-defined]

    out_features, in_features = shape
    codes, scales = get("qweight"), get("scales")
    mins = get("mins") if base + "mins" in located else None
    kinds = {torch.int8: "int8", torch.uint8: "int4"}
    kind = kinds.get(codes.dtype)
    problem = None
    if kind is None:
        problem = f"{base}qweight has dtype {codes.dtype}; expected int8 (int8) or uint8 (int4)"
    elif scales.dtype != torch.float16 or scales.dim() != 2 or scales.shape[0] != out_features:
        problem = (
            f"{base}scales must be float16 [{out_features}, groups], got {scales.dtype} {list(scales.shape)}"
        )
    elif scales.shape[1] == 0 or in_features % scales.shape[1]:
        problem = f"{base}scales has {scales.shape[1]} groups, which do not divide {in_features} inputs"
    elif tuple(codes.shape) != (out_features, in_features // (2 if kind == "int4" else 1)):
        problem = (
            f"{base}qweight has shape {list(codes.shape)}, which does not hold a {kind} {list(shape)} weight"
        )
    elif (kind == "int4") != (mins is not None):
        problem = f"{base}mins must be present for int4 codes (uint8) and absent for int8"
    elif mins is not None and (mins.dtype != torch.float16 or mins.shape != scales.shape):
        problem = f"{base}mins must be float16 shaped like {base}scales"
    if problem is not None:
        raise CheckpointError(f"{file.name}: {problem}")
    return QuantizedWeight(
        kind, codes, scales, mins, in_features // scales.shape[1], out_features, in_features
    )
