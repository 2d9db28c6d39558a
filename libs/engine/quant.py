"""Weight-only quantized formats for linear layers, and their torch reference.

Two formats, both in groups of `group_size` consecutive input features of one output row:

- int8: `value = q * scale`, q in [-127, 127] (symmetric). Quantized at load per output channel
  (one group spanning the row); a GGUF's Q8_0 tensors are int8 in groups of 32, taken as they are.
- int4: `value = q * scale + min`, q in [0, 15], groups of 32. Two values per byte in GGML's order:
  the low nibbles of a group's 16 bytes are its first 16 values, the high nibbles the last 16. A
  GGUF's Q4_1 tensors are exactly this; Q4_0's `(q - 8) * d` is this with `min = -8 d`.

Scales and minimums are kept as float16, as GGUF stores them, so a GGUF tensor loads without a
pass through float32 and quantize-at-load matches its rounding. `dequantize` and `linear` are the
reference the native kernels are tested against, and the implementation used on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libs.engine.config import QUANTIZATIONS
from libs.engine.errors import InvalidRequestError

GGUF_GROUP = 32  # the block size of GGML's Q8_0, Q4_0 and Q4_1


class UnsupportedTensorType(ValueError):
    """A GGUF tensor type the engine does not read as it is."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight. `qweight`: int8 [out, in] for int8, uint8
    [out, in / 2] (packed nibbles) for int4; `scales` (and `mins`, int4 only): float16
    [out, in / group_size]."""

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.numel() * self.mins.element_size()
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2 + extra


def quantize(weight: torch.Tensor, kind: str, group_size: int | None = None) -> QuantizedWeight:
    """Quantize a float weight at load: int8 per output channel (or in `group_size` groups), int4 in
    groups of `group_size` (default 32) with a scale and a minimum each."""
    w = weight.detach().to(torch.float32)
    out_features, in_features = w.shape
    if kind == "int8":
        group = group_size or in_features
        groups = _grouped(w, group)
        scales = (groups.abs().amax(-1) / 127.0).to(torch.float16)
        step = scales.to(torch.float32).unsqueeze(-1)
        q = torch.where(step > 0, groups / torch.where(step > 0, step, 1.0), 0.0).round().clamp(-127, 127)
        return QuantizedWeight(
            "int8", q.to(torch.int8).reshape(out_features, in_features), scales, None, group, *w.shape
        )
    if kind == "int4":
        group = group_size or GGUF_GROUP
        groups = _grouped(w, group)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15.0).to(torch.float16)
        mins = low.to(torch.float16)
        step = scales.to(torch.float32).unsqueeze(-1)
        shifted = groups - mins.to(torch.float32).unsqueeze(-1)
        q = torch.where(step > 0, shifted / torch.where(step > 0, step, 1.0), 0.0).round().clamp(0, 15)
        return QuantizedWeight("int4", _pack(q.to(torch.uint8)), scales, mins, group, *w.shape)
    raise ValueError(f"quantization: expected one of {', '.join(QUANTIZATIONS)}, got {kind!r}")


def from_gguf(type_name: str, blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8, one row of blocks per output row) as they are: Q8_0 as
    int8 in groups of 32, Q4_0 and Q4_1 as int4 in groups of 32. UnsupportedTensorType for any other
    type, naming it."""
    out_features, in_features = shape
    if in_features % GGUF_GROUP:
        raise UnsupportedTensorType(f"{type_name}: {in_features} input features are not whole blocks of 32")
    n_groups = in_features // GGUF_GROUP
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(out_features, n_groups, -1)
    if type_name == "Q8_0":  # per block: float16 d, 32 int8
        scales = raw[..., :2].copy().view(np.float16).reshape(out_features, n_groups)
        q = raw[..., 2:].copy().view(np.int8).reshape(out_features, in_features)
        return QuantizedWeight(
            "int8", torch.from_numpy(q), torch.from_numpy(scales), None, GGUF_GROUP, out_features, in_features
        )
    if type_name in ("Q4_0", "Q4_1"):  # per block: float16 d, (Q4_1: float16 m,) 16 bytes of nibbles
        header = 2 if type_name == "Q4_0" else 4
        scales = raw[..., :2].copy().view(np.float16).reshape(out_features, n_groups)
        if type_name == "Q4_1":
            mins = raw[..., 2:4].copy().view(np.float16).reshape(out_features, n_groups)
        else:  # (q - 8) d = q d - 8 d: exact in float16 (a power-of-two multiple)
            mins = (scales.astype(np.float32) * -8.0).astype(np.float16)
        packed = raw[..., header:].reshape(out_features, in_features // 2)
        return QuantizedWeight(
            "int4",
            torch.from_numpy(packed.copy()),
            torch.from_numpy(scales),
            torch.from_numpy(mins),
            GGUF_GROUP,
            out_features,
            in_features,
        )
    raise UnsupportedTensorType(f"tensor type {type_name} is not read as it is (supported: Q8_0, Q4_0, Q4_1)")


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [out_features, in_features]."""
    scales = w.scales.to(torch.float32).unsqueeze(-1)
    if w.kind == "int8":
        return (_grouped(w.qweight.to(torch.float32), w.group_size) * scales).reshape(
            w.out_features, w.in_features
        )
    q = unpack_nibbles(w.qweight, w.group_size).to(torch.float32)
    values = _grouped(q, w.group_size) * scales + w.mins.to(torch.float32).unsqueeze(-1)
    return values.reshape(w.out_features, w.in_features)


def same_format(parts: list[object]) -> bool:
    """Whether every part is a QuantizedWeight of one format (kind, groups, input width)."""
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return False
    return len({(p.kind, p.group_size, p.in_features) for p in parts}) == 1  # type: ignore[attr-defined]


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Several weights of one format stacked by output rows (q, k and v into one QKV weight)."""
    first = parts[0]
    for part in parts[1:]:
        if (part.kind, part.group_size, part.in_features) != (
            first.kind,
            first.group_size,
            first.in_features,
        ):
            raise ValueError(
                f"cannot fuse a {part.kind} weight (groups of {part.group_size}, {part.in_features} inputs) "
                f"with a {first.kind} one (groups of {first.group_size}, {first.in_features} inputs)"
            )
    if len(parts) == 1:
        return first
    return QuantizedWeight(
        first.kind,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        None if first.mins is None else torch.cat([p.mins for p in parts]),
        first.group_size,
        sum(p.out_features for p in parts),
        first.in_features,
    )


def rows(w: QuantizedWeight, index: torch.Tensor) -> torch.Tensor:
    """float32 rows `index` of the weight (an embedding lookup in a quantized table)."""
    picked = QuantizedWeight(
        w.kind,
        w.qweight[index],
        w.scales[index],
        None if w.mins is None else w.mins[index],
        w.group_size,
        index.numel(),
        w.in_features,
    )
    return dequantize(picked)


def to_device(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    mins = None if w.mins is None else w.mins.to(device)
    return QuantizedWeight(
        w.kind, w.qweight.to(device), w.scales.to(device), mins, w.group_size, w.out_features, w.in_features
    )


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference quantized linear: `x @ dequantize(w).T`, in x's dtype."""
    return torch.nn.functional.linear(x, dequantize(w).to(device=x.device, dtype=x.dtype), bias)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    out_features, in_features = w.shape
    if in_features % group:
        raise InvalidRequestError(
            "quantization", f"{in_features} input features are not a multiple of the group size {group}"
        )
    return w.reshape(out_features, in_features // group, group)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """[out, groups, 32] nibbles -> [out, in / 2] bytes, GGML's order within each group."""
    out_features, groups, group = q.shape
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(out_features, groups * half).contiguous()


def unpack_nibbles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """int4 codes [out, in / 2] bytes -> [out, in] values 0..15, undoing GGML's order in each group."""
    out_features = packed.shape[0]
    half = group // 2
    grouped = packed.reshape(out_features, -1, half)
    return torch.cat([grouped & 0x0F, grouped >> 4], dim=-1).reshape(out_features, -1)
