"""Batched LoRA and IA³ for a batch whose sequences use different adapters, in Triton.

Each sequence b owns the token rows [query_start_loc[b], query_start_loc[b+1]) and a CSR list of
entries [entry_ptr[b], entry_ptr[b+1]) (`libs/engine/adapters/batch.py`): for LoRA an entry is one
page of at most 8 rank rows in the pools (first row, row count, the request's weight), for IA³ a
table slot and a weight. The kernels read that list in place, on the device, so one launch serves
every adapter in the batch (the SGMV / BGMV shape of Punica, S-LoRA and vLLM), and a launch grid
depends only on host integers (the number of sequences, `max_query_len`, `max_entries`, widths):
nothing is synchronized, so a CUDA graph can capture it and replay it with other metadata.

LoRA takes two launches:

- shrink, one program per (sequence, block of its tokens, entry j): h = weight * x @ A_rowsᵀ in
  float32, written to columns [8j, 8j + 8) of an intermediate h [T, max_entries * 8];
- expand, one program per (sequence, block of its tokens, block of output columns): loops over the
  sequence's entries, accumulates h_j @ Bt_rows in a float32 tile and adds it to y once, so y is
  rounded once whatever the number of entries.

Both matmuls go through `tl.dot`, with the tokens as M (at least 16, masked: decode has one token
per sequence) and the page's 8 rows padded to 16 with masks (a GPU dot needs every dim >= 16).
Float32 operands use IEEE products (no TF32); two 16-bit operands of one dtype use the default dot,
accumulating in float32. A grid covers `max_query_len` tokens and `max_entries` entries for every
sequence; programs past a sequence's real tokens or entries return at once, and nothing past
entry_ptr[b+1] (a garbage tail in index / count / scale) is ever read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAGE_ROWS = 8  # rank rows in a pool page (libs/engine/adapters/device.py), h columns per entry
RANK_TILE = 16  # a page's rows padded to a dot's minimum dimension
BLOCK_K = 128  # shrink: input columns per step
BLOCK_N = 64  # expand / IA³: output columns per program


def _block_m(max_query_len: int) -> int:
    """Tokens per program: 16 for decode (the dot's minimum), up to 64 for prefill."""
    return min(64, max(16, triton.next_power_of_2(max_query_len)))


@triton.jit
def _lora_shrink_kernel(
    h_ptr,  # [T, max_entries * PAGE_ROWS] float32, written
    x_ptr,  # [T, K]
    a_ptr,  # [R, K]
    qsl_ptr,  # [B + 1] int32
    entry_ptr_ptr,  # [B + 1] int32
    index_ptr,  # [E] int32
    count_ptr,  # [E] int32
    scale_ptr,  # [E] float32
    K,
    stride_h,
    stride_x,
    stride_a,
    IEEE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    j = tl.program_id(2)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    first = start + m_block * BLOCK_M
    e_begin = tl.load(entry_ptr_ptr + b)
    e_end = tl.load(entry_ptr_ptr + b + 1)
    if first >= end or j >= e_end - e_begin:
        return
    e = e_begin + j
    row = tl.load(index_ptr + e).to(tl.int64)
    count = tl.load(count_ptr + e)
    weight = tl.load(scale_ptr + e)

    offs_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R] the page's rows, padded
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < end
    mask_r = offs_r < count
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    a_rows = a_ptr + (row + offs_r)[None, :] * stride_a  # [1, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [M, K]
        at = tl.load(a_rows + k[:, None], mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [K, R]
        if IEEE:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    h = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h + j * PAGE + offs_r[None, :]
    tl.store(h, acc * weight, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, out_total], updated at columns [col_offset, col_offset + N)
    h_ptr,  # [T, max_entries * PAGE_ROWS] float32, from the shrink
    bt_ptr,  # [R, N]
    qsl_ptr,  # [B + 1] int32
    entry_ptr_ptr,  # [B + 1] int32
    index_ptr,  # [E] int32
    count_ptr,  # [E] int32
    N,
    col_offset,
    stride_y,
    stride_h,
    stride_bt,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    first = start + m_block * BLOCK_M
    e_begin = tl.load(entry_ptr_ptr + b)
    e_end = tl.load(entry_ptr_ptr + b + 1)
    if first >= end or e_end <= e_begin:
        return

    offs_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R] the page's rows, padded
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of bt
    mask_m = offs_m < end
    mask_n = offs_n < N
    h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for e in range(e_begin, e_end):
        row = tl.load(index_ptr + e).to(tl.int64)
        mask_r = offs_r < tl.load(count_ptr + e)
        ht = tl.load(
            h_rows + (e - e_begin) * PAGE + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
        )  # [M, R] float32
        bt = tl.load(
            bt_ptr + (row + offs_r)[:, None] * stride_bt + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )  # [R, N]
        acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + col_offset + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ia3_kernel(
    y_ptr,  # [T, width_total], updated at columns [col_offset, col_offset + N)
    table_ptr,  # [slots, N]
    qsl_ptr,  # [B + 1] int32
    entry_ptr_ptr,  # [B + 1] int32
    index_ptr,  # [E] int32: table slot
    scale_ptr,  # [E] float32
    N,
    col_offset,
    stride_y,
    stride_table,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    first = start + m_block * BLOCK_M
    e_begin = tl.load(entry_ptr_ptr + b)
    e_end = tl.load(entry_ptr_ptr + b + 1)
    if first >= end or e_end <= e_begin:
        return

    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    factor = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)  # [BLOCK_N] product of the entries' factors
    for e in range(e_begin, e_end):
        slot = tl.load(index_ptr + e).to(tl.int64)
        weight = tl.load(scale_ptr + e)
        v = tl.load(table_ptr + slot * stride_table + offs_n, mask=mask_n, other=1.0).to(tl.float32)
        factor *= tl.where(weight == 1.0, v, 1.0 + weight * (v - 1.0))
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + col_offset + offs_n[None, :]
    mask = (offs_m < end)[:, None] & mask_n[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) * factor[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_csr(
    name: str,
    query_start_loc: torch.Tensor,
    entry_ptr: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    ints = [query_start_loc, entry_ptr, index] + ([count] if count is not None else [])
    if any(t.dtype != torch.int32 for t in ints) or scale.dtype != torch.float32:
        raise ValueError(f"{name}: query_start_loc, entry_ptr, index and count must be int32, scale float32")
    if entry_ptr.shape[0] < query_start_loc.shape[0]:
        raise ValueError(f"{name}: entry_ptr has {entry_ptr.shape[0]} rows, query_start_loc more")
    if scale.shape != index.shape or (count is not None and count.shape != index.shape):
        raise ValueError(f"{name}: index, count and scale must have one length")


def _check_rows(name: str, **tensors: torch.Tensor) -> None:
    for field, t in tensors.items():
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name}: {field} has dtype {t.dtype}, not float32 / bfloat16 / float16")
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: {field} must be 2-D with a contiguous last dimension")


def lora_apply(
    y: torch.Tensor,  # [T, out_total] model dtype, updated in place
    x: torch.Tensor,  # [T, K] model dtype
    a: torch.Tensor,  # [R, K] pool dtype: A rows
    bt: torch.Tensor,  # [R, N] pool dtype: B transposed, times the LoRA scaling
    col_offset: int,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    entry_ptr: torch.Tensor,  # [>= B + 1] int32
    index: torch.Tensor,  # [E] int32: an entry's first row in a / bt
    count: torch.Tensor,  # [E] int32: its rows, 1..8
    scale: torch.Tensor,  # [E] float32: the request's weight
    max_query_len: int,
    max_entries: int,
) -> None:
    """y[t, col_offset:col_offset+N] += Σ_e scale[e] (x[t] A_eᵀ) Bt_e over token t's sequence's entries.

    The delta is summed in float32 and y rounded once; tokens of sequences without entries are left
    untouched. `max_query_len` and `max_entries` bound every sequence's tokens and entries (host
    integers: they size the grids and the intermediate)."""
    _check_rows("lora_apply", y=y, x=x, a=a, bt=bt)
    _check_csr("lora_apply", query_start_loc, entry_ptr, index, scale, count)
    k, n = a.shape[1], bt.shape[1]
    if x.shape[1] != k or bt.shape[0] != a.shape[0] or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_apply: x {tuple(x.shape)}, a {tuple(a.shape)}, bt {tuple(bt.shape)} disagree")
    if col_offset < 0 or col_offset + n > y.shape[1]:
        raise ValueError(f"lora_apply: columns [{col_offset}, {col_offset + n}) are outside y")
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs <= 0 or max_query_len <= 0 or max_entries <= 0 or y.shape[0] == 0:
        return
    # Two 16-bit operands of one dtype take the tensor-core dot; anything with float32 takes IEEE. So
    # does bfloat16 under the interpreter (CPU tensors), whose dot multiplies bfloat16's uint16 bit
    # patterns (triton-lang/triton#11584); bf16 products are exact in float32, so the sums agree.
    ieee = not (x.dtype == a.dtype and x.dtype != torch.float32)
    ieee = ieee or (x.dtype == torch.bfloat16 and x.device.type == "cpu")
    block_m = _block_m(max_query_len)
    m_blocks = triton.cdiv(max_query_len, block_m)
    # h: [T, max_entries * 8]; only (token, entry) pairs that exist are written, and only they are read
    h = torch.empty((x.shape[0], max_entries * PAGE_ROWS), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(num_seqs, m_blocks, max_entries)](
        h,
        x,
        a,
        query_start_loc,
        entry_ptr,
        index,
        count,
        scale,
        k,
        h.stride(0),
        x.stride(0),
        a.stride(0),
        IEEE=ieee,
        PAGE=PAGE_ROWS,
        BLOCK_M=block_m,
        BLOCK_R=RANK_TILE,
        BLOCK_K=BLOCK_K,
    )
    _lora_expand_kernel[(num_seqs, m_blocks, triton.cdiv(n, BLOCK_N))](
        y,
        h,
        bt,
        query_start_loc,
        entry_ptr,
        index,
        count,
        n,
        col_offset,
        y.stride(0),
        h.stride(0),
        bt.stride(0),
        PAGE=PAGE_ROWS,
        BLOCK_M=block_m,
        BLOCK_R=RANK_TILE,
        BLOCK_N=BLOCK_N,
    )


def ia3_scale(
    y: torch.Tensor,  # [T, width_total], updated in place
    col_offset: int,
    table: torch.Tensor,  # [slots, n] pool dtype: IA³ vectors
    query_start_loc: torch.Tensor,  # [B + 1] int32
    entry_ptr: torch.Tensor,  # [>= B + 1] int32
    index: torch.Tensor,  # [E] int32: table slot
    scale: torch.Tensor,  # [E] float32: the request's weight
    max_query_len: int,
) -> None:
    """y[t, col_offset:col_offset+n] *= Π_e l_e over token t's sequence's entries, in float32.

    l_e is the table row when the weight is 1, else 1 + weight (row - 1); y is rounded once."""
    _check_rows("ia3_scale", y=y, table=table)
    _check_csr("ia3_scale", query_start_loc, entry_ptr, index, scale)
    n = table.shape[1]
    if col_offset < 0 or col_offset + n > y.shape[1]:
        raise ValueError(f"ia3_scale: columns [{col_offset}, {col_offset + n}) are outside y")
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs <= 0 or max_query_len <= 0 or y.shape[0] == 0:
        return
    block_m = _block_m(max_query_len)
    _ia3_kernel[(num_seqs, triton.cdiv(max_query_len, block_m), triton.cdiv(n, BLOCK_N))](
        y,
        table,
        query_start_loc,
        entry_ptr,
        index,
        scale,
        n,
        col_offset,
        y.stride(0),
        table.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
    )
