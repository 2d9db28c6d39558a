"""The decoder layer's small ops, each fused into one Triton launch.

Between the matmuls a layer runs RMSNorm (with the residual add), SiLU·mul, and the rotary embedding
with the KV-cache write. Written with torch they are several launches each, every one reading and
writing the whole activation; here each is one launch in which a program owns a token row, loads it
once, keeps the intermediate values in registers and writes only the results: the residual sum and
its norm in one pass, gate and up in one pass, and q/k norm, rotation, the q write and both cache
writes in one pass.

The numerics follow `TorchOps` (libs/engine/kernels/reference.py): the arithmetic is in float32, and
RMSNorm rounds where torch does (the normalised value to the input's dtype, then its product with the
weight), so half-precision results equal torch's but for the odd ulp (the float32 sum's order, a GPU's
approximate rsqrt). SiLU·mul and the rotation round once, from float32.

Grids come from tensor shapes only and nothing is read back to the host, so every function can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    # About 256 elements per warp, between 1 and 16 warps.
    return min(max(block // 256, 1), 16)


@triton.jit
def _normalize(h, w, n, eps):
    """The row h [BLOCK] (zero past n) RMS-normalised with torch's rounding points, times w: float32."""
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)
    # Rounded to the input's dtype before the weight, as `weight * h.to(dtype)` in the reference.
    return (hf * rstd).to(h.dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, out_stride, n, eps, BLOCK: tl.constexpr):
    # One program per row: x [T, n] (row stride x_stride), w [n], out [T, n].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = _normalize(x, w, n, eps)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, x_stride, r_ptr, r_stride, w_ptr, n, eps, BLOCK: tl.constexpr):
    # One program per row: x, r [T, n] both updated in place (r <- x + r, x <- norm(r)), w [n].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n
    x_row, r_row = x_ptr + row * x_stride + cols, r_ptr + row * r_stride + cols
    x = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_row, mask=mask, other=0.0).to(tl.float32)
    # The sum is rounded to the dtype, as torch's `x + residual`, and normalised from that value.
    total = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_row, total, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = _normalize(total, w, n, eps)
    tl.store(x_row, out.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, n, BLOCK: tl.constexpr):
    # Program (row, column block): x [T, 2n] as gate | up, out [T, n].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rotate(
    row_ptr, w_ptr, cos, sin, heads, dims, mask, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """The rotated halves (float32, [BLOCK_H, BLOCK_HALF] each) of the heads at row_ptr, RMS-normalised
    with w first when HAS_NORM."""
    half = HEAD_DIM // 2
    first = row_ptr + heads * HEAD_DIM + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    if HAS_NORM:
        # A head's sum of squares runs over both halves, so each half is normalised with the whole.
        dtype = row_ptr.dtype.element_ty
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        ss = tl.sum(tl.where(mask, x1f * x1f + x2f * x2f, 0.0), axis=1)
        rstd = tl.expand_dims(tl.rsqrt(ss / HEAD_DIM + eps), 1)  # [BLOCK_H, 1]
        w1 = tl.load(w_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        x1 = ((x1f * rstd).to(dtype).to(tl.float32) * w1).to(dtype)
        x2 = ((x2f * rstd).to(dtype).to(tl.float32) * w2).to(dtype)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr,
    qkv_stride,
    pos_ptr,
    cos_sin_ptr,
    cos_sin_stride,
    slot_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kc_block,
    kc_head,
    kc_offset,
    vc_block,
    vc_head,
    vc_offset,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: qkv [T, (Hq + 2 Hkv) * D], q_out [T, Hq, D], caches [blocks, Hkv, bs, D]
    # (strides kc_* / vc_*, the last one 1), cos_sin [max_pos, D] float32.
    half = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    pos = tl.load(pos_ptr + token).to(tl.int64)
    table = cos_sin_ptr + pos * cos_sin_stride + dims
    cos = tl.load(table, mask=dims < half, other=0.0)
    sin = tl.load(table + half, mask=dims < half, other=0.0)
    row = qkv_ptr + token * qkv_stride

    q_heads = tl.arange(0, BLOCK_HQ)[:, None]  # [BLOCK_HQ, 1]
    q_mask = (q_heads < NUM_HEADS) & (dims < half)
    q1, q2 = _norm_rotate(row, q_norm_ptr, cos, sin, q_heads, dims, q_mask, eps, HAS_Q_NORM, HEAD_DIM)
    q_out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + q_heads * HEAD_DIM + dims
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + half, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # Slot -1 (a padding token) reads and writes no k/v head; the clamp keeps even the unused
    # addresses in range. (The head bound carries the slot test: the interpreter mishandles a
    # scalar mask `&` a block.)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block, offset = tl.maximum(slot, 0) // BLOCK_SIZE, tl.maximum(slot, 0) % BLOCK_SIZE
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]  # [BLOCK_HKV, 1]
    kv_mask = (kv_heads < tl.where(slot >= 0, NUM_KV_HEADS, 0)) & (dims < half)
    k_row = row + NUM_HEADS * HEAD_DIM
    k1, k2 = _norm_rotate(k_row, k_norm_ptr, cos, sin, kv_heads, dims, kv_mask, eps, HAS_K_NORM, HEAD_DIM)
    k_dst = k_cache_ptr + block * kc_block + kv_heads * kc_head + offset * kc_offset + dims
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_dst + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)

    v_src = k_row + NUM_KV_HEADS * HEAD_DIM + kv_heads * HEAD_DIM + dims
    v_dst = v_cache_ptr + block * vc_block + kv_heads * vc_head + offset * vc_offset + dims
    v1 = tl.load(v_src, mask=kv_mask, other=0.0)
    v2 = tl.load(v_src + half, mask=kv_mask, other=0.0)
    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_dst + half, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{name} must be [T, H] with a contiguous last dim, got {tuple(t.shape)} {t.stride()}"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A new [T, H] tensor: each row of x [T, H] RMS-normalised, times weight [H] (x's dtype)."""
    _check_rows("x", x)
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x,
        x.stride(0),
        weight.contiguous(),
        out,
        out.stride(0),
        n,
        eps,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual, then x <- rms_norm(residual), both in place; returns (x, residual)."""
    _check_rows("x", x)
    _check_rows("residual", residual)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    rows, n = x.shape
    if rows == 0:
        return x, residual
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x,
        x.stride(0),
        residual,
        residual.stride(0),
        weight.contiguous(),
        n,
        eps,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """A new [T, I] tensor silu(gate) * up from x [T, 2I] laid out as gate | up."""
    _check_rows("x", x)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {width}")
    n = width // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    grid = (rows, triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](
        x, x.stride(0), out, out.stride(0), n, BLOCK=block, num_warps=_num_warps(block)
    )
    return out


def rope_and_cache(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] as q | k | v
    positions: torch.Tensor,  # [T] int32 / int64
    cos_sin: torch.Tensor,  # [max_pos, D] float32, cos | sin
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    slot_mapping: torch.Tensor,  # [T] int32 / int64, -1 writes nothing
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,  # [D] or None
    k_norm: torch.Tensor | None,  # [D] or None
    eps: float,
) -> torch.Tensor:
    """A new contiguous q [T, Hq, D], normalised (q_norm) and rotated; k normalised (k_norm) and rotated,
    and v as it is, written into the caches at each token's slot."""
    _check_rows("qkv", qkv)
    rows, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(
            f"qkv width {width} is not (num_heads {num_heads} + 2 * num_kv_heads {num_kv_heads}) "
            f"* head_dim {head_dim} with an even head_dim"
        )
    if cos_sin.shape[1] != head_dim or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin must be [max_pos, {head_dim}] with a contiguous last dim")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[1] != num_kv_heads or cache.shape[3] != head_dim:
            raise ValueError(f"{name} must be [blocks, {num_kv_heads}, block_size, {head_dim}]")
        if cache.stride(3) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
    block_size = k_cache.shape[2]
    if v_cache.shape[2] != block_size or block_size & (block_size - 1):
        raise ValueError(f"the caches' block sizes must be one power of two, got {block_size}")
    q = torch.empty((rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return q
    block_hq, block_hkv = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    _rope_and_cache_kernel[(rows,)](
        qkv,
        qkv.stride(0),
        positions,
        cos_sin,
        cos_sin.stride(0),
        slot_mapping,
        q,
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        qkv if q_norm is None else q_norm.contiguous(),  # an unread stand-in when there is no norm
        qkv if k_norm is None else k_norm.contiguous(),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HAS_Q_NORM=q_norm is not None,
        HAS_K_NORM=k_norm is not None,
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_hq * block_half),
    )
    return q
