"""LoRA expand: y[:, slice's columns] += Σ_e weight_e h_e Bt_e, for every slice of a fused
projection in one launch, y rounded once.

A program owns one sequence, one block of its tokens and one block of BLOCK_N output columns of
one slice: the slices' column blocks are numbered one after the other (q's, then k's, then v's), so
the grid has exactly as many column blocks as the slices have and a program finds its slice by
comparing its block with the slices' first blocks (host integers). It loops over the sequence's
entries for that slice: adds the shrink's split partials in split order (the sum over K, combined
once), multiplies by the request's weight, and accumulates h_e Bt_e in a float32 tile that is
added to y at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from libs.engine.kernels.reference import LoraSlice
from libs.engine.kernels.triton.slices import output_blocks, per_slice, pick, pick_int


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, out_total], updated at each slice's columns
    h_ptr,  # [S, SPLITS, T, max_entries * PAGE] float32, from the shrink
    qsl_ptr,  # [B + 1] int32
    bt0_ptr,  # [R_s, N_s] each slice's B rows (transposed, times the LoRA scaling)
    bt1_ptr,
    bt2_ptr,
    entry_ptr0_ptr,  # [>= B + 1] int32 each slice's CSR pointers
    entry_ptr1_ptr,
    entry_ptr2_ptr,
    index0_ptr,  # [E_s] int32: an entry's first row in bt
    index1_ptr,
    index2_ptr,
    count0_ptr,  # [E_s] int32: its rows, 1..8
    count1_ptr,
    count2_ptr,
    scale0_ptr,  # [E_s] float32: the request's weight
    scale1_ptr,
    scale2_ptr,
    n0,  # each slice's width
    n1,
    n2,
    col0,  # each slice's first column in y
    col1,
    col2,
    stride_bt0,
    stride_bt1,
    stride_bt2,
    first_block1,  # the flat column block where slice 1 begins (the total when it is absent)
    first_block2,
    num_splits,
    max_entries,
    stride_y,
    stride_h_slice,
    stride_h_split,
    stride_h_row,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    flat_block = tl.program_id(2)
    s = (flat_block >= first_block1).to(tl.int32) + (flat_block >= first_block2).to(tl.int32)
    n_block = flat_block - pick_int(s, 0, first_block1, first_block2)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    first = start + m_block * BLOCK_M
    entry_ptr = pick(s, entry_ptr0_ptr, entry_ptr1_ptr, entry_ptr2_ptr)
    e_begin = tl.load(entry_ptr + b)
    e_end = tl.minimum(tl.load(entry_ptr + b + 1), e_begin + max_entries)  # as the shrink bounds it
    if first >= end or e_end <= e_begin:
        return
    bt_ptr = pick(s, bt0_ptr, bt1_ptr, bt2_ptr)
    index_ptr = pick(s, index0_ptr, index1_ptr, index2_ptr)
    count_ptr = pick(s, count0_ptr, count1_ptr, count2_ptr)
    scale_ptr = pick(s, scale0_ptr, scale1_ptr, scale2_ptr)
    n = pick_int(s, n0, n1, n2)
    col = pick_int(s, col0, col1, col2)
    stride_bt = pick_int(s, stride_bt0, stride_bt1, stride_bt2)

    offs_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R] a page's rows, padded
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of the slice
    mask_m = offs_m < end
    mask_n = offs_n < n
    h_rows = h_ptr + s.to(tl.int64) * stride_h_slice + offs_m.to(tl.int64)[:, None] * stride_h_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for e in range(e_begin, e_end):
        row = tl.load(index_ptr + e).to(tl.int64)
        mask_r = offs_r < tl.load(count_ptr + e)
        mask_h = mask_m[:, None] & mask_r[None, :]
        h = h_rows + (e - e_begin) * PAGE + offs_r[None, :]  # [M, R]
        ht = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(0, num_splits):
            ht += tl.load(h + split * stride_h_split, mask=mask_h, other=0.0)
        bt = tl.load(
            bt_ptr + (row + offs_r)[:, None] * stride_bt + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )  # [R, N]
        acc += tl.dot(ht * tl.load(scale_ptr + e), bt.to(tl.float32), input_precision="ieee")
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + col + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def expand(
    y: torch.Tensor,  # [T, out_total]
    h: torch.Tensor,  # [S, splits, T, max_entries * PAGE] float32, from the shrink
    slices: list[LoraSlice],
    query_start_loc: torch.Tensor,  # [B + 1] int32
    m_blocks: int,
    block_m: int,
    block_n: int,
    page: int,
    rank_tile: int,
) -> None:
    """One launch over (sequence, token block, the slices' column blocks); every size a host integer."""
    num_seqs = query_start_loc.shape[0] - 1
    total_blocks, first_block = output_blocks([s.bt.shape[1] for s in slices], block_n)
    padded = per_slice(slices)
    entries = [s.entries for s in padded]
    _lora_expand_kernel[(num_seqs, m_blocks, total_blocks)](
        y,
        h,
        query_start_loc,
        *(s.bt for s in padded),
        *(e.entry_ptr for e in entries),
        *(e.index for e in entries),
        *(e.count for e in entries),
        *(e.scale for e in entries),
        *(s.bt.shape[1] for s in padded),
        *(s.col_offset for s in padded),
        *(s.bt.stride(0) for s in padded),
        first_block[1],
        first_block[2],
        h.shape[1],
        h.shape[3] // page,
        y.stride(0),
        h.stride(0),
        h.stride(1),
        h.stride(2),
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_R=rank_tile,
        BLOCK_N=block_n,
    )
