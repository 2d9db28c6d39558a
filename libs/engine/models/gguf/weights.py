"""The GGUF's tensors as HF float32 weights: names, shapes, dequantization, the Q/K un-permute, and the
streaming model.safetensors writer."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from libs.engine.models.gguf.reader import GGUFImportError, Metadata

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

_Producer = Callable[[], np.ndarray]


def tensor_plan(meta: Metadata, config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], _Producer]]:
    """Each output tensor as (HF name, HF shape, producer of its float32 data), checked up front."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    ffn = config["intermediate_size"]
    expected = {
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (n_heads * head_dim, hidden),
        "self_attn.k_proj": (n_kv_heads * head_dim, hidden),
        "self_attn.v_proj": (n_kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, n_heads * head_dim),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    n_layers = config["num_hidden_layers"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["vocab_size"], hidden),
    }
    for layer in range(n_layers):
        shapes.update({f"model.layers.{layer}.{part}.weight": shape for part, shape in expected.items()})

    plan = []
    for gguf_name, tensor in meta.tensors.items():
        hf_name, heads = _hf_name(gguf_name, n_layers, n_heads, n_kv_heads)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost-first
        if shape != shapes[hf_name]:
            expected_shape = list(shapes[hf_name])
            raise GGUFImportError(f"tensor {gguf_name!r} has shape {list(shape)}, expected {expected_shape}")
        _check_tensor_type(gguf_name, tensor)
        plan.append((hf_name, shape, _producer(tensor, shape, heads)))
    missing = sorted(set(shapes) - {name for name, _, _ in plan} - {"lm_head.weight"})
    if missing:
        raise GGUFImportError(f"the GGUF lacks {len(missing)} tensors, among them {missing[0]!r} (HF name)")
    return sorted(plan, key=lambda entry: entry[0])


def _hf_name(gguf_name: str, n_layers: int, n_heads: int, n_kv_heads: int) -> tuple[str, int | None]:
    """The HF name of a GGUF tensor, and the head count to un-permute its rows by (Q and K only)."""
    if gguf_name == "rope_freqs.weight":
        raise GGUFImportError(
            "tensor 'rope_freqs.weight' (Llama 3.1-style rope frequency factors) "
            "cannot be represented faithfully in an HF Llama config"
        )
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], None
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS or int(match.group(1)) >= n_layers:
        raise GGUFImportError(f"unsupported tensor {gguf_name!r} for a Llama model")
    layer, kind = int(match.group(1)), match.group(2)
    heads = {"attn_q": n_heads, "attn_k": n_kv_heads}.get(kind)
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight", heads


def _check_tensor_type(name: str, tensor: Any) -> None:
    # Dequantizing the first row is cheap and fails the same way the whole tensor would.
    sample = tensor.data[:1] if tensor.data.ndim > 1 else tensor.data
    try:
        dequantize(sample, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        type_name = GGMLQuantizationType(tensor.tensor_type).name
        raise GGUFImportError(f"unsupported tensor type {type_name} (tensor {name!r})") from exc


def _producer(tensor: Any, shape: tuple[int, ...], heads: int | None) -> _Producer:
    def produce() -> np.ndarray:
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        return weights if heads is None else _unpermute_rows(weights, heads)

    return produce


def _unpermute_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: it stores each head's rows as interleaved (even, odd) rotary
    pairs, while HF keeps the first half of the rotary dimensions before the second half."""
    rows, cols = weights.shape
    # weights: [n_heads * head_dim, cols] viewed as [n_heads, head_dim / 2, 2, cols]
    return weights.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_safetensors(path: Path, plan: list[tuple[str, tuple[int, ...], _Producer]]) -> None:
    """Stream the tensors into one safetensors file, one tensor in memory at a time: a 7B model in
    float32 would not fit in memory at once, which the `safetensors` library's writer needs."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in plan:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format wants the data section 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, _, produce in plan:
            f.write(memoryview(np.ascontiguousarray(produce(), dtype="<f4")).cast("B"))
