"""Compute kernels for the engine: native C++ CPU kernels and a pure-torch reference.

`select_ops` picks the operator set for a model on a device: the native kernels on a CPU in
float32 when they build, the torch reference otherwise (CUDA, other dtypes, no compiler).
"""

from __future__ import annotations

import torch

from libs.engine.kernels.build import load, load_error
from libs.engine.kernels.reference import AttentionMetadata, HeadLayout, LinearWeight, TorchOps

__all__ = ["AttentionMetadata", "HeadLayout", "LinearWeight", "TorchOps", "select_ops"]

KERNEL_CHOICES = ("auto", "native", "torch")


def select_ops(
    preference: str, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[TorchOps, str]:
    """The operator set to use and a one-line reason, honouring `preference` (auto/native/torch)."""
    if preference not in KERNEL_CHOICES:
        raise ValueError(f"kernels: expected one of {', '.join(KERNEL_CHOICES)}, got {preference!r}")
    if preference == "torch":
        return TorchOps(), "torch operators (requested)"
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
