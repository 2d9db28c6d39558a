"""What the attention kernels of this package share: the product they take and their tile sizes, so
that every attention path keeps one numerics contract (float32 accumulation, IEEE float32 products
for float32 inputs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """a @ b accumulated in float32: IEEE float32 products for float32 inputs (no TF32), the
    tensor-core dot for 16-bit ones. Triton's interpreter multiplies bfloat16 operands as their
    uint16 bit patterns, so there (DOT_UPCAST) they go to float32 first: products of two bfloat16
    values are exact in float32, which is what a tensor-core dot computes too."""
    if DOT_UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def load_kv_tile(
    k_ptr,
    v_ptr,
    table_row,
    keys,
    key_ok,
    kv_head,
    dims,
    dim_ok,
    stride_kb,
    stride_kh,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
):
    """The keys and values [N, D] of token positions `keys` of one KV head, read through the
    sequence's block-table row where they lie in the paged cache (zeros where masked)."""
    block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)  # [N]
    # int64: block * stride_kb passes 2**31 elements in a large cache.
    slot = block * stride_kb + kv_head * stride_kh + (keys % BLOCK_SIZE) * stride_kt  # [N]
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
    v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
    return k, v


def dot_flags(q: torch.Tensor) -> dict[str, bool]:
    """The `dot` constexprs for queries (and caches) of q's dtype on q's device."""
    return {
        "IEEE": q.dtype == torch.float32,
        "DOT_UPCAST": q.device.type == "cpu" and q.dtype == torch.bfloat16,
    }


def key_tile(dtype: torch.dtype) -> int:
    """Keys per tile: 64, or 32 in float32 to bound shared memory (its key and value tiles take
    twice the bytes)."""
    return 32 if dtype == torch.float32 else 64


def dim_tile(head_dim: int) -> int:
    """The head dim rounded up to a power of two, at least 16 (the smallest K `tl.dot` takes)."""
    return max(triton.next_power_of_2(head_dim), 16)
