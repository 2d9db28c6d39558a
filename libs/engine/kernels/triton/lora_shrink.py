"""LoRA shrink: h = x A_eᵀ for every (sequence, entry) pair of a step, every slice of a fused
projection, in one launch, with K split across programs.

A program owns one sequence, one block of its tokens, one slice and one split of K, and loops over
that sequence's real entries for the slice (`lora.py` explains the grid). Per entry it multiplies its
x tile by the page's A rows over its K range and writes the partial sum, in float32, to
h[slice, split, token, 8 j + r] (j: the entry's place in the sequence's list). The expand adds the
splits' partials, in split order, so the sum over K is combined once and the same way every time:
no atomics, no second pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.engine.kernels.reference import LoraSlice
from libs.engine.kernels.triton.slices import per_slice, pick, pick_int


@triton.jit
def _lora_shrink_kernel(
    h_ptr,  # [S, SPLITS, T, max_entries * PAGE] float32: partial sums, written
    x_ptr,  # [T, K]
    qsl_ptr,  # [B + 1] int32
    a0_ptr,  # [R_s, K] each slice's A rows
    a1_ptr,
    a2_ptr,
    entry_ptr0_ptr,  # [>= B + 1] int32 each slice's CSR pointers
    entry_ptr1_ptr,
    entry_ptr2_ptr,
    index0_ptr,  # [E_s] int32: an entry's first row in a
    index1_ptr,
    index2_ptr,
    count0_ptr,  # [E_s] int32: its rows, 1..8
    count1_ptr,
    count2_ptr,
    stride_a0,
    stride_a1,
    stride_a2,
    K,
    k_per_split,  # inputs per split, a multiple of BLOCK_K
    num_splits,
    max_entries,
    stride_x,
    stride_h_slice,
    stride_h_split,
    stride_h_row,
    IEEE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    s = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    first = start + m_block * BLOCK_M
    entry_ptr = pick(s, entry_ptr0_ptr, entry_ptr1_ptr, entry_ptr2_ptr)
    e_begin = tl.load(entry_ptr + b)
    # Entries past max_entries have no columns in h (the caller's bound; a guard, not a case)
    e_end = tl.minimum(tl.load(entry_ptr + b + 1), e_begin + max_entries)
    if first >= end or e_end <= e_begin:
        return
    a_ptr = pick(s, a0_ptr, a1_ptr, a2_ptr)
    index_ptr = pick(s, index0_ptr, index1_ptr, index2_ptr)
    count_ptr = pick(s, count0_ptr, count1_ptr, count2_ptr)
    stride_a = pick_int(s, stride_a0, stride_a1, stride_a2)
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)

    offs_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R] a page's rows, padded
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < end
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    h_base = s.to(tl.int64) * stride_h_slice + split.to(tl.int64) * stride_h_split
    h_rows = h_ptr + h_base + offs_m.to(tl.int64)[:, None] * stride_h_row  # [BLOCK_M, 1]
    for e in range(e_begin, e_end):
        row = tl.load(index_ptr + e).to(tl.int64)
        mask_r = offs_r < tl.load(count_ptr + e)
        a_rows = a_ptr + (row + offs_r)[None, :] * stride_a  # [1, BLOCK_R]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + offs_k
            mask_k = k < k_end
            xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [M, K]
            at = tl.load(a_rows + k[:, None], mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [K, R]
            if IEEE:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        h = h_rows + (e - e_begin) * PAGE + offs_r[None, :]
        tl.store(h, acc, mask=mask_m[:, None] & mask_r[None, :])


def shrink(
    h: torch.Tensor,  # [S, splits, T, max_entries * PAGE] float32, written where entries exist
    x: torch.Tensor,  # [T, K]
    slices: list[LoraSlice],
    query_start_loc: torch.Tensor,  # [B + 1] int32
    m_blocks: int,
    k_per_split: int,
    ieee: bool,
    block_m: int,
    block_k: int,
    page: int,
    rank_tile: int,
) -> None:
    """One launch over (sequence, token block, slice × split); every size is a host integer."""
    num_seqs, num_splits = query_start_loc.shape[0] - 1, h.shape[1]
    a = per_slice([s.a for s in slices])
    entries = per_slice([s.entries for s in slices])
    _lora_shrink_kernel[(num_seqs, m_blocks, len(slices) * num_splits)](
        h,
        x,
        query_start_loc,
        *a,
        *(e.entry_ptr for e in entries),
        *(e.index for e in entries),
        *(e.count for e in entries),
        *(t.stride(0) for t in a),
        x.shape[1],
        k_per_split,
        num_splits,
        h.shape[3] // page,
        x.stride(0),
        h.stride(0),
        h.stride(1),
        h.stride(2),
        IEEE=ieee,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_R=rank_tile,
        BLOCK_K=block_k,
    )
