"""Compute kernels for the engine: native C++ CPU kernels, Triton GPU kernels, and a pure-torch
reference.

`select_ops` picks the operator set for a model on a device: on a CPU in float32 the native
kernels when they build; on CUDA the Triton kernels when Triton is installed; the torch reference
otherwise (other dtypes on a CPU, no compiler, no Triton).
"""

from __future__ import annotations

import torch

from libs.engine.kernels.build import load, load_error
from libs.engine.kernels.reference import (
    AttentionMetadata,
    HeadLayout,
    Ia3Slice,
    LinearWeight,
    LoraSlice,
    TorchOps,
)
from libs.engine.kernels.triton import unavailable_reason as triton_unavailable

__all__ = [
    "AttentionMetadata",
    "HeadLayout",
    "Ia3Slice",
    "LinearWeight",
    "LoraSlice",
    "TorchOps",
    "select_ops",
]

KERNEL_CHOICES = ("auto", "native", "triton", "torch")


def select_ops(
    preference: str, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[TorchOps, str]:
    """The operator set to use and a one-line reason, honouring `preference` (auto/native/triton/torch)."""
    if preference not in KERNEL_CHOICES:
        raise ValueError(f"kernels: expected one of {', '.join(KERNEL_CHOICES)}, got {preference!r}")
    if preference == "torch":
        return TorchOps(), "torch operators (requested)"
    if preference == "triton" or (preference == "auto" and device.type == "cuda"):
        return _triton(preference, device)
    if not load():
        reason = f"native kernels unavailable ({load_error()})"
        if preference == "native":
            raise RuntimeError(f"kernels: {reason}")
        return TorchOps(), reason
    from libs.engine.kernels.native import NativeOps

    unsupported = NativeOps.supports(head_dim, device, dtype)
    if unsupported is None:
        return NativeOps(), "native CPU kernels"
    if preference == "native":
        raise RuntimeError(f"kernels: {unsupported}")
    return TorchOps(), f"torch operators ({unsupported})"


def _triton(preference: str, device: torch.device) -> tuple[TorchOps, str]:
    unavailable = triton_unavailable(device.type)
    if unavailable is not None:
        if preference == "triton":
            raise RuntimeError(f"kernels: {unavailable}")
        return TorchOps(), f"torch operators ({unavailable})"
    from libs.engine.kernels.gpu import TritonOps

    where = "under the Triton interpreter" if device.type == "cpu" else "on the GPU"
    return TritonOps(), f"Triton kernels {where}"
