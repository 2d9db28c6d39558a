"""Rotary position embedding tables, with the scaling types HF checkpoints declare.

The formulas follow the published methods (linear interpolation, Llama 3.1's frequency-band
scaling, YaRN); the numerics follow transformers so that logits match it: float32 inverse
frequencies, positions multiplied in float32, cos/sin scaled by the attention factor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from libs.engine.models.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def normalize_rope_parameters(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """One dict with `rope_type`, `rope_theta` and the type's fields, from old or new config styles.

    Older configs carry `rope_theta` plus an optional `rope_scaling` dict (with `type` or
    `rope_type`); transformers 5 writes a single `rope_parameters` dict.
    """
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
    }.get(rope_type, ())
    for key in needed:
        if params.get(key) is None:
            raise CheckpointError(f"{source}: rope scaling {rope_type!r} needs field {key!r}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor is not supported")
    return params


def inverse_frequencies(params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the attention factor applied to cos/sin."""
    base = float(params["rope_theta"])
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params, factor), 1.0
    return _yarn(params, dim, base, factor)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any], factor: float) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(params: dict[str, Any], dim: int, base: float, factor: float) -> tuple[torch.Tensor, float]:
    original = float(params["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def cos_sin_table(params: dict[str, Any], head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of each row, sin in the second."""
    inv_freq, attention_factor = inverse_frequencies(params, head_dim)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1).contiguous()
