"""Batched IA³ in Triton: y[:, slice's columns] *= Π_e l_e, one launch for every slice of a fused
projection (q, k and v; gate and up), whatever adapters the batch holds.

Each sequence b owns the token rows [query_start_loc[b], query_start_loc[b+1]) and, per slice, a
CSR list of entries [entry_ptr[b], entry_ptr[b+1]) (`libs/engine/adapters/batch.py`): a table slot
and the request's weight. A program owns one sequence, one block of its tokens and one block of
BLOCK_N columns of one slice (the slices' column blocks numbered one after the other, as in
`lora_expand.py`); it multiplies the entries' factors in float32 and scales y once. The grid comes
from host integers (sequences, `max_query_len`, widths); programs past a sequence's tokens or of
a sequence without entries return at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from libs.engine.kernels.reference import Ia3Slice
from libs.engine.kernels.triton.slices import (
    block_m,
    check_columns,
    check_csr,
    check_rows,
    check_same_dtype,
    check_slices,
    output_blocks,
    per_slice,
    pick,
    pick_int,
)

BLOCK_N = 64  # output columns per program


@triton.jit
def _ia3_kernel(
    y_ptr,  # [T, width_total], updated at each slice's columns
    qsl_ptr,  # [B + 1] int32
    table0_ptr,  # [slots, N_s] each slice's IA³ vectors
    table1_ptr,
    table2_ptr,
    entry_ptr0_ptr,  # [>= B + 1] int32 each slice's CSR pointers
    entry_ptr1_ptr,
    entry_ptr2_ptr,
    index0_ptr,  # [E_s] int32: table slot
    index1_ptr,
    index2_ptr,
    scale0_ptr,  # [E_s] float32: the request's weight
    scale1_ptr,
    scale2_ptr,
    n0,  # each slice's width
    n1,
    n2,
    col0,  # each slice's first column in y
    col1,
    col2,
    stride_table0,
    stride_table1,
    stride_table2,
    first_block1,  # the flat column block where slice 1 begins (the total when it is absent)
    first_block2,
    stride_y,
    BLOCK_M: tl.constexpr,
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
    e_end = tl.load(entry_ptr + b + 1)
    if first >= end or e_end <= e_begin:
        return
    table_ptr = pick(s, table0_ptr, table1_ptr, table2_ptr)
    index_ptr = pick(s, index0_ptr, index1_ptr, index2_ptr)
    scale_ptr = pick(s, scale0_ptr, scale1_ptr, scale2_ptr)
    n = pick_int(s, n0, n1, n2)
    col = pick_int(s, col0, col1, col2)
    stride_table = pick_int(s, stride_table0, stride_table1, stride_table2)

    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    factor = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)  # [BLOCK_N] product of the entries' factors
    for e in range(e_begin, e_end):
        slot = tl.load(index_ptr + e).to(tl.int64)
        weight = tl.load(scale_ptr + e)
        v = tl.load(table_ptr + slot * stride_table + offs_n, mask=mask_n, other=1.0).to(tl.float32)
        factor *= tl.where(weight == 1.0, v, 1.0 + weight * (v - 1.0))
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + col + offs_n[None, :]
    mask = (offs_m < end)[:, None] & mask_n[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) * factor[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def ia3_scale(
    y: torch.Tensor,  # [T, width_total], updated in place
    slices: Sequence[Ia3Slice],  # 1 to 3, owning disjoint columns of y
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,
) -> None:
    """y[t, s.col_offset : s.col_offset + n_s] *= Π_e l_e for each slice s, over token t's
    sequence's entries of that slice, in float32.

    l_e is the table row when the weight is 1, else 1 + weight (row - 1); y is rounded once."""
    slices = list(slices)
    check_slices("ia3_scale", len(slices))
    check_rows("ia3_scale", y=y)
    check_same_dtype("ia3_scale", "table", [s.table for s in slices])
    for s in slices:
        check_rows("ia3_scale", table=s.table)
        check_csr("ia3_scale", query_start_loc, s.entries, lora=False)
        check_columns("ia3_scale", y.shape[1], s.col_offset, s.table.shape[1])
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs <= 0 or max_query_len <= 0 or y.shape[0] == 0:
        return
    m = block_m(max_query_len)
    total_blocks, first_block = output_blocks([s.table.shape[1] for s in slices], BLOCK_N)
    padded = per_slice(slices)
    entries = [s.entries for s in padded]
    _ia3_kernel[(num_seqs, triton.cdiv(max_query_len, m), total_blocks)](
        y,
        query_start_loc,
        *(s.table for s in padded),
        *(e.entry_ptr for e in entries),
        *(e.index for e in entries),
        *(e.scale for e in entries),
        *(s.table.shape[1] for s in padded),
        *(s.col_offset for s in padded),
        *(s.table.stride(0) for s in padded),
        first_block[1],
        first_block[2],
        y.stride(0),
        BLOCK_M=m,
        BLOCK_N=BLOCK_N,
    )
