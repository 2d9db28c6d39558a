"""The GGUF's tensors as HF weights: names, shapes, dequantization, the Q/K un-permute, and the
streaming model.safetensors writer.

By default every tensor is dequantized to float32. With `keep_quantized`, the projections and the
LM head stored as Q8_0, Q4_0 or Q4_1 are written as they are, in the engine's int8 / int4 row
layout (libs/engine/quant.py, models/loader.py): codes, float16 scales and minimums, exactly the
file's numbers. Float tensors stay float; any other quantized type is refused, by name.
"""

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

from libs.engine import quant
from libs.engine.models.config import is_quantizable
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
# One tensor of model.safetensors: its name, shape, safetensors dtype and a producer of its data.
Entry = tuple[str, tuple[int, ...], str, _Producer]
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I8": np.dtype("i1"), "U8": np.dtype("u1")}
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # read as they are by quant.from_gguf
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def tensor_plan(meta: Metadata, config: dict[str, Any], keep_quantized: bool = False) -> list[Entry]:
    """Every output tensor, checked up front."""
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

    plan: list[Entry] = []
    for gguf_name, tensor in meta.tensors.items():
        hf_name, heads = _hf_name(gguf_name, n_layers, n_heads, n_kv_heads)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost-first
        if shape != shapes[hf_name]:
            expected_shape = list(shapes[hf_name])
            raise GGUFImportError(f"tensor {gguf_name!r} has shape {list(shape)}, expected {expected_shape}")
        type_name = GGMLQuantizationType(tensor.tensor_type).name
        if keep_quantized and is_quantizable(hf_name, config["tie_word_embeddings"]):
            if type_name in KEPT_TYPES:
                plan.extend(_kept_entries(tensor, type_name, hf_name, shape, heads))
                continue
            if type_name not in _FLOAT_TYPES:
                raise GGUFImportError(
                    f"tensor {gguf_name!r} has type {type_name}, which is not kept as it is "
                    f"(kept: {', '.join(KEPT_TYPES)}; float types stay float); import it without "
                    "--keep-quantized to dequantize it to float32"
                )
        _check_tensor_type(gguf_name, tensor)
        plan.append((hf_name, shape, "F32", _producer(tensor, shape, heads)))
    names = {name for name, _, _, _ in plan} | {
        name.removesuffix("qweight") + "weight" for name, _, _, _ in plan if name.endswith(".qweight")
    }
    missing = sorted(set(shapes) - names - {"lm_head.weight"})
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


def _kept_entries(
    tensor: Any, type_name: str, hf_name: str, shape: tuple[int, ...], heads: int | None
) -> list[Entry]:
    """The codes, scales and (int4) minimums of a Q8_0 / Q4_0 / Q4_1 tensor as they are, rows in
    HF order."""
    try:
        probe = quant.from_gguf(type_name, np.asarray(tensor.data[:1]), (1, shape[1]))
    except quant.UnsupportedTensorType as exc:
        raise GGUFImportError(f"tensor {hf_name!r}: {exc}") from exc
    base = hf_name.removesuffix("weight")

    def part(field: str) -> np.ndarray:
        w = quant.from_gguf(type_name, np.asarray(tensor.data), shape)
        array = getattr(w, field).numpy()
        if heads is not None:  # the un-permute moves whole rows, blocks and all
            array = array[_unpermute_rows(np.arange(shape[0])[:, None], heads)[:, 0]]
        return array

    codes_dtype = "I8" if probe.kind == "int8" else "U8"
    entries: list[Entry] = [
        (base + "qweight", (shape[0], probe.qweight.shape[1]), codes_dtype, lambda: part("qweight")),
        (base + "scales", (shape[0], probe.scales.shape[1]), "F16", lambda: part("scales")),
    ]
    if probe.mins is not None:
        entries.append((base + "mins", (shape[0], probe.mins.shape[1]), "F16", lambda: part("mins")))
    return entries


def _unpermute_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: it stores each head's rows as interleaved (even, odd) rotary
    pairs, while HF keeps the first half of the rotary dimensions before the second half."""
    rows, cols = weights.shape
    # weights: [n_heads * head_dim, cols] viewed as [n_heads, head_dim / 2, 2, cols]
    return weights.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_safetensors(path: Path, plan: list[Entry]) -> None:
    """Stream the tensors into one safetensors file, one tensor in memory at a time: a 7B model in
    float32 would not fit in memory at once, which the `safetensors` library's writer needs."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in plan:
        size = _DTYPES[dtype].itemsize * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format wants the data section 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, dtype, produce in plan:
            data = np.ascontiguousarray(produce(), dtype=_DTYPES[dtype])
            if data.shape != shape:  # a producer bug would otherwise shift every later tensor
                raise GGUFImportError(
                    f"internal error: {name} came out {list(data.shape)}, planned {list(shape)}"
                )
            f.write(memoryview(data).cast("B"))
