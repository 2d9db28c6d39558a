"""Paged attention that reads the block-table KV cache in place: decode, prefill and chunked prefill
mixed in one batch, with the semantics of `TorchOps.attention` (kernels/reference.py).

Tiling. One program owns one sequence, one KV head and a block of BLOCK_Q of that sequence's
queries. The M dimension of its tile packs those queries with the GROUP query heads that share the
KV head (row r is query r // GROUP_P, head r % GROUP_P, GROUP_P = GROUP rounded up to a power of
two), so each key and value tile is loaded once per KV head rather than once per query head. A
decode step has one query per sequence: BLOCK_Q is then the fewest queries that make M = 16, the
smallest M `tl.dot` takes on a GPU (the extra rows are masked); a batch with longer queries uses
M = 64. Keys are walked in tiles of BLOCK_N tokens (64, or 32 for float32 to bound shared memory)
that may span several cache blocks: each key row's address is gathered through the block table
(token t is block_tables[b, t // block_size], offset t % block_size), so nothing is copied.

Softmax is the online (FlashAttention) one in float32 with exp2 and the scale folded into
log2(e); the output is normalized once at the end. float32 inputs use IEEE dots (no TF32) so they
match the torch reference closely; bfloat16 / float16 use tensor-core dots accumulating in float32.

The grid (B, Hkv, cdiv(max_query_len, BLOCK_Q)) is built from host integers only. A program whose
query block lies past its sequence's q_len returns at once, and the key loop's bound is read from
seq_lens and query_start_loc on the device, so a launch syncs nothing and a CUDA graph can
capture it. A decode step with few (sequence, KV head) pairs and long contexts runs instead the
split over keys of `split_kv.py` (flash-decoding), chosen there from host integers only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from libs.engine.kernels.triton import split_kv
from libs.engine.kernels.triton.attention_tiles import dim_tile, dot, dot_flags, key_tile, load_kv_tile

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [num_blocks, Hkv, block_size, D] contiguous
    v_ptr,  # same layout as k
    out_ptr,  # [T, Hq * D], last dim contiguous
    block_tables_ptr,  # [B, W]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    qk_scale,  # scale * log2(e): scores go straight to exp2
    stride_qt,
    stride_qh,
    stride_kb,  # k and v share their (contiguous) strides
    stride_kh,
    stride_kt,
    stride_bt,
    stride_ot,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # queries per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_P tile rows
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    IEEE: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_first = tl.program_id(2) * BLOCK_Q  # this program's first query within its sequence
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP_P  # [M] query within the sequence
    head = kv_head * GROUP + rows % GROUP_P  # [M] query head
    row_ok = (q_idx < q_len) & (rows % GROUP_P < GROUP)
    position = context + q_idx  # [M] the last key each row may see
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)  # [M] row of q and out

    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0
    )  # [M, D]

    # Finite, not -inf, so that exp2(m_i - m_new) can never be exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys past the tile's last query are masked for every row, so the walk stops there.
    kv_end = tl.minimum(seq_len, context + q_first + BLOCK_Q)
    table_row = block_tables_ptr + seq * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [N] token positions
        key_ok = keys < kv_end
        k, v = load_kv_tile(
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
            BLOCK_SIZE,
        )

        s = dot(q, tl.trans(k), IEEE, DOT_UPCAST)  # [M, N] float32
        visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # [M] rescales what was accumulated under the old maximum
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, DOT_UPCAST)
        m_i = m_new

    # Every row sees key 0 (position >= 0), so l_i > 0.
    acc = acc / l_i[:, None]
    out_offsets = token[:, None] * stride_ot + head[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D] contiguous
    v_cache: torch.Tensor,  # same shape
    block_tables: torch.Tensor,  # [B, W] int32, padded with the null block 0
    seq_lens: torch.Tensor,  # [B] int32, contiguous
    query_start_loc: torch.Tensor,  # [B + 1] int32, contiguous
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, Hq * D] in q's dtype
) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len tokens) over its cached keys,
    read through the block table; returns `out` ([T, Hq * D] in q's dtype), allocated if not given.

    `max_query_len` (a host int, at least every sequence's q_len) sizes the grid, and with
    `max_seq_len` (a host int, AttentionMetadata's) picks a decode step's split over keys
    (`split_kv.py`), so the launch reads no device value and can be captured in a CUDA graph."""
    num_tokens, hq, head_dim = _check(q, k_cache, v_cache, block_tables, query_start_loc, out)
    _, hkv, block_size, _ = k_cache.shape
    if out is None:
        out = q.new_empty(num_tokens, hq * head_dim)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    splits = split_kv.num_splits(
        num_seqs, hkv, max_query_len, max_seq_len, split_kv.multiprocessors(q.device)
    )
    if splits > 1:
        return split_kv.split_kv_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, splits, out
        )

    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    # Decode: the fewest rows tl.dot takes (16); longer queries: 64-row tiles.
    block_m = max(16 if max_query_len * group_p <= 16 else 64, group_p)
    block_q = block_m // group_p
    block_d = dim_tile(head_dim)
    grid = (num_seqs, hkv, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=key_tile(q.dtype),
        BLOCK_SIZE=block_size,
        **dot_flags(q),
        num_warps=8 if block_m * block_d >= 64 * 128 else 4,
        num_stages=2,
    )
    return out


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """(T, Hq, D) once the shapes, dtypes and layouts the kernel assumes hold; ValueError naming the
    argument otherwise. Shapes only: nothing here reads a device value."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hq, D] with a contiguous last dim, got {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be one of {_DTYPES}, got {q.dtype}")
    num_tokens, hq, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or hq % k_cache.shape[1] != 0:
        raise ValueError(
            f"k_cache must be [num_blocks, Hkv, block_size, {head_dim}] with Hkv dividing {hq}, "
            f"got {tuple(k_cache.shape)}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.shape != k_cache.shape or cache.dtype != q.dtype or not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous, {tuple(k_cache.shape)} and {q.dtype}")
    if block_tables.dim() != 2 or query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(
            f"block_tables must be [B, W] and query_start_loc [B + 1], got {tuple(block_tables.shape)} "
            f"and {tuple(query_start_loc.shape)}"
        )
    if out is not None and (
        out.shape != (num_tokens, hq * head_dim) or out.dtype != q.dtype or out.stride(-1) != 1
    ):
        raise ValueError(f"out must be [{num_tokens}, {hq * head_dim}] {q.dtype}, got {tuple(out.shape)}")
    return num_tokens, hq, head_dim
