"""The engine's GPU kernels, written in Triton: paged attention that reads the block table in place
(split over keys for decode steps too small to occupy the GPU), RMSNorm with its residual add,
rotary embedding with the KV-cache write, SiLU·mul, and the batched LoRA / IA³ kernels.
`kernels/gpu.py` puts them behind the operator interface.

Every kernel takes its launch grid from host integers only (shapes and bounds the runner knows),
never from a device value, and synchronizes nothing, so a CUDA graph can capture it. On a machine
without a GPU they run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`), which is
how `make test` checks them against the torch reference operators.
"""

from __future__ import annotations

import os


def unavailable_reason(device_type: str) -> str | None:
    """None when the Triton kernels can run on `device_type` here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels run on the CPU only under its interpreter (TRITON_INTERPRET=1)"
    if device_type not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA (device is {device_type})"
    return None
