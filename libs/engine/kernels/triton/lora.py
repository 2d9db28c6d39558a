"""Batched LoRA for a batch whose sequences use different adapters, in Triton: two launches per
fused projection, whatever its slices and adapters.

Each sequence b owns the token rows [query_start_loc[b], query_start_loc[b+1]) and, per slice, a
CSR list of entries [entry_ptr[b], entry_ptr[b+1]) (`libs/engine/adapters/batch.py`): one page of
at most 8 rank rows in the slice's pools (first row, row count, the request's weight). The kernels
read those lists in place, on the device, so one launch serves every adapter in the batch (the
SGMV / BGMV shape of Punica, S-LoRA and vLLM) and every slice of a fused projection (q, k and v;
gate and up), each slice with its own pools, entries and columns (`slices.py`).

- shrink (`lora_shrink.py`): h = x A_eᵀ in float32, grid (sequences, token blocks, slices × K
  splits);
- expand (`lora_expand.py`): y += Σ_e weight_e h_e Bt_e, grid (sequences, token blocks, the slices'
  output column blocks), y rounded once whatever the number of entries.

Programs follow the real work: a program loops over its sequence's real entries, so the grid
depends on the batch (its sequences, `max_query_len`) and the widths, never on the bound of 32
entries a captured step holds (`cuda_graphs.py`); programs past a sequence's tokens, or of a
sequence without entries for their slice, return at once, and nothing past entry_ptr[b+1] (a
garbage tail in index / count / scale) is read. With few tokens the batch alone gives too few
programs for a long K (down_proj's 8192 or 14336 inputs), so the shrink splits K (`split_k`): each
split writes its partial sum to its own plane of h, and the expand adds the planes in split order,
so the partials are combined once, without atomics, and the same way every run.

Every size comes from host integers (the number of sequences, `max_query_len`, `max_entries`, the
token count, widths): nothing is synchronized, so a CUDA graph can capture both launches and replay
them with other metadata.

Both matmuls go through `tl.dot`, with the tokens as M (at least 16, masked: decode has one token
per sequence) and a page's 8 rows padded to 16 with masks (a GPU dot needs every dim >= 16).
Float32 operands use IEEE products (no TF32); two 16-bit operands of one dtype use the default dot,
accumulating in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from libs.engine.kernels.reference import LoraSlice
from libs.engine.kernels.triton.lora_expand import expand
from libs.engine.kernels.triton.lora_shrink import shrink
from libs.engine.kernels.triton.slices import (
    block_m,
    check_columns,
    check_csr,
    check_rows,
    check_same_dtype,
    check_slices,
)

PAGE_ROWS = 8  # rank rows in a pool page (libs/engine/adapters/device.py), h columns per entry
RANK_TILE = 16  # a page's rows padded to a dot's minimum dimension
BLOCK_K = 128  # shrink: input columns per step
BLOCK_N = 64  # expand: output columns per program
# K splits: a split gets at least this many BLOCK_K steps (512 inputs), and a shrink aims at this
# many programs per slice, about four per multiprocessor of an H100 (132); more only add partials.
SPLIT_MIN_STEPS = 4
SHRINK_PROGRAMS = 512
H_BYTES = 64 << 20  # the most the split planes of h may take: a long prefill splits less


@dataclass(frozen=True)
class LaunchShape:
    """A step's LoRA launches, from host integers."""

    block_m: int  # tokens per program
    m_blocks: int  # token blocks per sequence
    splits: int  # K splits of the shrink
    k_per_split: int  # inputs per split, a multiple of BLOCK_K


def launch_shape(k: int, num_tokens: int, num_seqs: int, max_query_len: int, h_row_bytes: int) -> LaunchShape:
    """Token blocks and K splits for a shrink over k inputs of `num_tokens` tokens in `num_seqs`
    sequences: splits until the shrink has about SHRINK_PROGRAMS programs per slice, none shorter than
    SPLIT_MIN_STEPS steps, and h (`h_row_bytes` a token per split) within H_BYTES."""
    m = block_m(max_query_len)
    # (sequence, token block) pairs with tokens: a block per sequence, plus the blocks of long ones
    programs = max(1, min(num_tokens, num_seqs - 1 + triton.cdiv(num_tokens, m)))
    steps = triton.cdiv(k, BLOCK_K)
    splits = min(steps // SPLIT_MIN_STEPS, triton.cdiv(SHRINK_PROGRAMS, programs))
    splits = max(1, min(splits, H_BYTES // max(1, num_tokens * h_row_bytes)))
    # Recounted so that no split is empty: every split writes its plane of h, the expand reads them all.
    steps_per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, steps_per_split)
    return LaunchShape(m, triton.cdiv(max_query_len, m), splits, steps_per_split * BLOCK_K)


def lora_apply(
    y: torch.Tensor,  # [T, out_total] model dtype, updated in place
    x: torch.Tensor,  # [T, K] model dtype
    slices: Sequence[LoraSlice],  # 1 to 3, owning disjoint columns of y
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,
    max_entries: int,
) -> None:
    """y[t, s.col_offset : s.col_offset + N_s] += Σ_e scale[e] (x[t] A_eᵀ) Bt_e for each slice s,
    over token t's sequence's entries of that slice.

    The delta is summed in float32 and y rounded once; tokens of sequences without entries are left
    untouched. `max_query_len` and `max_entries` bound every sequence's tokens and entries (host
    integers: they size the grids and the intermediate)."""
    slices = list(slices)
    check_slices("lora_apply", len(slices))
    check_rows("lora_apply", y=y, x=x)
    check_same_dtype("lora_apply", "a", [s.a for s in slices])
    check_same_dtype("lora_apply", "bt", [s.bt for s in slices])
    k = x.shape[1]
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_apply: x has {x.shape[0]} rows, y {y.shape[0]}")
    for s in slices:
        check_rows("lora_apply", a=s.a, bt=s.bt)
        check_csr("lora_apply", query_start_loc, s.entries, lora=True)
        if s.a.shape[1] != k or s.bt.shape[0] != s.a.shape[0]:
            shapes = f"x {tuple(x.shape)}, a {tuple(s.a.shape)}, bt {tuple(s.bt.shape)}"
            raise ValueError(f"lora_apply: {shapes} disagree")
        check_columns("lora_apply", y.shape[1], s.col_offset, s.bt.shape[1])
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs <= 0 or max_query_len <= 0 or max_entries <= 0 or y.shape[0] == 0:
        return
    a_dtype = slices[0].a.dtype
    # Two 16-bit operands of one dtype take the tensor-core dot; anything with float32 takes IEEE. So
    # does bfloat16 under the interpreter (CPU tensors), whose dot multiplies bfloat16's uint16 bit
    # patterns (triton-lang/triton#11584); bf16 products are exact in float32, so the sums agree.
    ieee = not (x.dtype == a_dtype and x.dtype != torch.float32)
    ieee = ieee or (x.dtype == torch.bfloat16 and x.device.type == "cpu")
    h_row = max_entries * PAGE_ROWS
    shape = launch_shape(k, x.shape[0], num_seqs, max_query_len, len(slices) * h_row * 4)
    # h: only (slice, split, token, entry) places that exist are written, and only they are read
    h = torch.empty((len(slices), shape.splits, x.shape[0], h_row), dtype=torch.float32, device=x.device)
    shrink(
        h,
        x,
        slices,
        query_start_loc,
        shape.m_blocks,
        shape.k_per_split,
        ieee,
        shape.block_m,
        BLOCK_K,
        PAGE_ROWS,
        RANK_TILE,
    )
    expand(y, h, slices, query_start_loc, shape.m_blocks, shape.block_m, BLOCK_N, PAGE_ROWS, RANK_TILE)
