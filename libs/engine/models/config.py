"""The model description the engine needs, read from an HF checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.engine.models.errors import CheckpointError
from libs.engine.models.rope import normalize_rope_parameters

__all__ = [
    "STORED_QUANT_METHOD",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "ModelConfig",
    "is_quantizable",
]

# config.json's quantization_config.quant_method for checkpoints whose weights are stored in the
# engine's own int8 / int4 formats (libs/engine/quant.py).
STORED_QUANT_METHOD = "expert-grouped"


def is_quantizable(name: str, tie_word_embeddings: bool) -> bool:
    """Whether a weight (HF name) is one a quantization applies to: every projection, and the LM
    head (the embedding table when tied). Norms, biases and an untied input embedding stay float."""
    head = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
    return name.endswith("_proj.weight") or name == head


# Architecture name in config.json -> (family, has q/k/v bias, has per-head QK norm).
# Llama's biases follow its `attention_bias` / `mlp_bias` fields instead of being fixed.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a decoder checkpoint (Llama, Qwen2 or Qwen3 family)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict[str, Any] = field(hash=False)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # The checkpoint stores its linear weights quantized (`expertctl model import-gguf
    # --keep-quantized`): codes, scales and minimums under each weight's name (models/loader.py).
    stored_quantized: bool = False
    raw: dict[str, Any] = field(default_factory=dict, hash=False, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (not a checkpoint directory?)")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate an HF config dict and keep what the engine uses."""
        architecture = _architecture(raw, source)
        family, fixed_qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
        hidden = int(_required(raw, "hidden_size", source))
        num_heads = int(_required(raw, "num_attention_heads", source))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        _check_supported_features(raw, source)
        attention_bias = bool(raw.get("attention_bias", False))
        if family == "llama":
            qkv_bias, o_bias = attention_bias, attention_bias
        else:
            qkv_bias, o_bias = fixed_qkv_bias or attention_bias, False
        stored_quantized = _stored_quantized(raw, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            architecture=architecture,
            vocab_size=int(_required(raw, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_required(raw, "intermediate_size", source)),
            num_layers=int(_required(raw, "num_hidden_layers", source)),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=qk_norm,
            rope=normalize_rope_parameters(raw, source),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            stored_quantized=stored_quantized,
            raw=raw,
        )


def _required(raw: dict[str, Any], name: str, source: str) -> Any:
    if raw.get(name) is None:
        raise CheckpointError(f"{source}: field {name!r} is missing")
    return raw[name]


def _architecture(raw: dict[str, Any], source: str) -> str:
    """The checkpoint's architecture, one of SUPPORTED_ARCHITECTURES."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise CheckpointError(f"{source}: field 'architectures' is missing")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise CheckpointError(
            f"{source}: architecture {architecture!r} is not supported (supported: {supported})"
        )
    return architecture


def _check_supported_features(raw: dict[str, Any], source: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window is not supported")


def _stored_quantized(raw: dict[str, Any], source: str) -> bool:
    """Whether the linear weights are stored in the engine's own quantized formats (the only
    quantization_config accepted)."""
    if raw.get("quantization_config") is None:
        return False
    method = (raw["quantization_config"] or {}).get("quant_method")
    if method != STORED_QUANT_METHOD:
        raise CheckpointError(
            f"{source}: quantization_config.quant_method {method!r} is not supported "
            f"(only {STORED_QUANT_METHOD!r}, which `expertctl model import-gguf "
            "--keep-quantized` writes)"
        )
    return True
