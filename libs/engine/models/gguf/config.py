"""config.json and generation_config.json for an HF Llama checkpoint, from the GGUF's metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from libs.engine.models.gguf.reader import GGUFImportError, Metadata


def llama_config(meta: Metadata) -> dict[str, Any]:
    """The HF `LlamaForCausalLM` config.json; what it cannot express is a `GGUFImportError`."""
    if meta.get_int("llama.expert_count", 0) > 0:
        raise GGUFImportError("mixture-of-experts Llama variants (llama.expert_count > 0) are not supported")
    hidden = meta.get_int("llama.embedding_length")
    n_heads = meta.get_int("llama.attention.head_count")
    n_kv_heads = meta.get_int("llama.attention.head_count_kv", n_heads)
    head_dim = meta.get_int("llama.attention.key_length", hidden // n_heads)
    if meta.get_int("llama.attention.value_length", head_dim) != head_dim:
        raise GGUFImportError("llama.attention.value_length differs from key_length (one head_dim in HF)")
    if meta.get_int("llama.rope.dimension_count", head_dim) != head_dim:
        raise GGUFImportError("llama.rope.dimension_count differs from the head size (partial rotary)")
    if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise GGUFImportError(f"head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta.get_int("llama.feed_forward_length"),
        "num_hidden_layers": meta.get_int("llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.get_float("llama.attention.layer_norm_rms_epsilon"),
        # llama.cpp's default when the file names no base frequency.
        "rope_theta": meta.get_float("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get_int("llama.context_length"),
        "vocab_size": meta.get_int("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens"))),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(meta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta: Metadata) -> dict[str, Any] | None:
    if meta.has("llama.rope.scaling.type"):
        kind, factor = meta.get("llama.rope.scaling.type"), meta.get_float("llama.rope.scaling.factor", 1.0)
    else:  # older files only have this key, for linear scaling
        kind, factor = "linear", meta.get_float("llama.rope.scale_linear", 1.0)
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise GGUFImportError(f"unsupported rope scaling type {kind!r} (llama.rope.scaling.type)")
    if meta.get_float("llama.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
        raise GGUFImportError("YaRN with yarn_ext_factor != 1 cannot be represented in an HF config")
    if meta.get_float("llama.rope.scaling.yarn_log_multiplier", 0.0) != 0.0:
        raise GGUFImportError("YaRN with a yarn_log_multiplier cannot be represented in an HF Llama config")
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": meta.get_int("llama.rope.scaling.original_context_length"),
        "beta_fast": meta.get_float("llama.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": meta.get_float("llama.rope.scaling.yarn_beta_slow", 1.0),
    }
    attn_factor = meta.get_float("llama.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:
        # llama.cpp multiplies its attn_factor into YaRN's own 0.1*ln(s)+1; HF replaces it instead.
        scaling["attention_factor"] = attn_factor * (0.1 * math.log(factor) + 1.0)
    return scaling


# The sampling a model's authors recommend, under llama.cpp's keys (its converter writes them from the
# checkpoint's generation_config.json) and generation_config.json's names.
SAMPLING_KEYS = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.penalty_repeat": ("repetition_penalty", float),
}


def generation_config(meta: Metadata, sampling: Mapping[str, float] | None = None) -> dict[str, Any]:
    """generation_config.json: the special token ids, with every token that ends generation, and the
    recommended sampling the file carries; `sampling` adds to it (for a file that carries none)."""
    eos = meta.get("tokenizer.ggml.eos_token_id", None)
    # llama.cpp also ends generation on the end-of-turn / end-of-message tokens when the file names them.
    stops = [eos] + [meta.get(f"tokenizer.ggml.{key}", None) for key in ("eot_token_id", "eom_token_id")]
    stops = list(dict.fromkeys(token_id for token_id in stops if token_id is not None))
    config = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
    }
    for key, (name, kind) in SAMPLING_KEYS.items():
        if meta.has(key):
            config[name] = kind(meta.get(key))
    config.update(sampling or {})
    return config
