"""Decode attention split over keys (flash-decoding): when a decode step has too few (sequence, KV
head) pairs to occupy the GPU, each pair's keys are cut into `num_splits` parts walked by programs
of their own, and a second kernel combines the parts.

Why. The single-pass kernel (`attention.py`) runs one program per (sequence, KV head) in a decode
step: at batch 1 with 8 KV heads that is 8 programs on a GPU of 132 multiprocessors, each walking
the whole context alone. Splitting the keys multiplies the programs by `num_splits` and divides
each program's walk by as much, for the price of writing and re-reading one float32 partial
result per query head and split.

Pass 1 (`_partial_kernel`, grid (B, Hkv, num_splits)): the program of split s walks keys
[s * split_len, (s + 1) * split_len) of its sequence with the single-pass kernel's tile (the query
heads sharing the KV head packed in the tile's rows) and online softmax, and writes its running
max (in log2 units), its sum of exponentials and its unnormalised output to a float32 scratch.
Pass 2 (`_combine_kernel`, grid (B, Hq)): rescales each split to the largest max, sums, and
normalises once, as the single-pass kernel does at its end.

split_len is computed per sequence on the device: cdiv(seq_len, num_splits) rounded up to a whole
key tile. So each sequence spreads its keys over the splits whatever its length, a sequence
shorter than the others uses only the first few splits (programs past its keys return at once,
and the combine reads only the splits that hold keys), and no result depends on `max_seq_len`
bounding the real lengths: that host integer only picks the split count.

Graph capture. `num_splits` decides only grid and scratch sizes, and it comes from host integers
(the number of sequences, KV heads, `max_seq_len`, the multiprocessor count). In a captured decode
step the runner passes the model's max_model_len as `max_seq_len` (`runner.py`,
`_decode_forward`), fixed for the captured size, so a graph's split count never changes across its
replays; the per-sequence split lengths above keep every shorter real context correct under it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from libs.engine.kernels.triton.attention_tiles import dim_tile, dot, dot_flags, key_tile, load_kv_tile

# Splits per (sequence, KV head), at most: the combine kernel loads every split's partial in one
# [MAX_SPLITS, D] tile (a power of two), and 32 splits of 256 keys already cover an 8k context.
MAX_SPLITS = 32
# Keys of max_seq_len per split, at least: four 64-key tiles, so that the partial result each split
# writes and the combine reads back (D + 2 floats per query head) stays small beside the keys it
# walks. A starting point, not a measurement: bench/gpu_kernels.py is where it would be tuned.
MIN_KEYS_PER_SPLIT = 256
# Under Triton's interpreter (CPU tensors) there are no multiprocessors; an H100 SXM's count stands
# in, so the CPU tests take the path a GPU would.
INTERPRETER_SMS = 132


def num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """How many parts a step's attention splits each sequence's keys into; 1 means the single-pass
    kernel. Only decode steps (max_query_len 1) split, and only when their (sequence, KV head) pairs
    leave at least half the `num_sms` multiprocessors idle and `max_seq_len` gives every split at
    least MIN_KEYS_PER_SPLIT keys. Host integers only, so a captured graph's choice is fixed."""
    pairs = num_seqs * num_kv_heads
    if max_query_len != 1 or pairs <= 0:
        return 1
    # Floor: the split programs fill the multiprocessors at most once, never a second partial wave.
    splits = min(MAX_SPLITS, num_sms // pairs, max_seq_len // MIN_KEYS_PER_SPLIT)
    return splits if splits >= 2 else 1


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of `device` (INTERPRETER_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    # Read once per device: a property query, no device work, so it is safe inside a capture too.
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of a sequence of seq_len keys: an equal share rounded up to whole key tiles
    (at least one tile), computed the same way by both passes."""
    share = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(share, BLOCK_N)


@triton.jit
def _partial_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [num_blocks, Hkv, block_size, D] contiguous
    v_ptr,  # same layout as k
    partial_ptr,  # [B, Hq, num_splits, D] float32: each split's unnormalised output
    stats_ptr,  # [B, Hq, num_splits, 2] float32: each split's running max (log2 units) and sum
    block_tables_ptr,  # [B, W]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    qk_scale,  # scale * log2(e): scores go straight to exp2
    num_splits,
    num_heads,  # Hq
    stride_qt,
    stride_qh,
    stride_kb,  # k and v share their (contiguous) strides
    stride_kh,
    stride_kt,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # tile rows: GROUP rounded up to a power of two, at least 16
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    IEEE: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)  # the sequence's one query
    q_len = tl.load(query_start_loc_ptr + seq + 1) - token
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    if (q_len == 0) | (start >= seq_len):
        return  # no keys here: the combine reads only splits that start before seq_len
    end = tl.minimum(seq_len, start + split_len)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows  # [M] query head
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_row = q_ptr + token.to(tl.int64) * stride_qt
    q = tl.load(q_row + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)  # [M, D]

    # Finite, not -inf, so that exp2(m_i - m_new) can never be exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # A decode query is its sequence's last token: it sees every cached key, so the only mask is
    # the split's end.
    table_row = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)  # [N] token positions
        key_ok = keys < end
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
        s = tl.where(key_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # [M] rescales what was accumulated under the old maximum
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, DOT_UPCAST)
        m_i = m_new

    part = ((seq * num_heads + head) * num_splits + split).to(tl.int64)  # [M] scratch row
    tl.store(partial_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
    tl.store(stats_ptr + part * 2, m_i, mask=row_ok)
    tl.store(stats_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    partial_ptr,  # [B, Hq, num_splits, D] float32
    stats_ptr,  # [B, Hq, num_splits, 2] float32
    out_ptr,  # [T, Hq * D], last dim contiguous
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_splits,
    num_heads,  # Hq
    stride_ot,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # MAX_SPLITS: one variant whatever num_splits is
    BLOCK_N: tl.constexpr,  # the partial kernel's keys per tile (its split lengths are multiples)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:
        return  # no query: row `token` belongs to the next sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits that start before seq_len hold at least one key each (the partial kernel wrote them);
    # the others were never written.
    used = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < used
    part = (seq * num_heads + head) * num_splits + splits  # [S] scratch rows
    m = tl.load(stats_ptr + part * 2, mask=split_ok, other=-1.0e30)  # [S]
    sums = tl.load(stats_ptr + part * 2 + 1, mask=split_ok, other=0.0)  # [S]
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(
        partial_ptr + part[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [S, D]

    # Each split's sums were taken under its own max; bring them all under the largest.
    weight = tl.where(split_ok, tl.exp2(m - tl.max(m, 0)), 0.0)  # [S]
    total = tl.sum(weight * sums, 0)  # > 0: the split holding the largest max has a sum >= 1
    o = tl.sum(weight[:, None] * acc, 0) / total  # [D]
    out_offsets = token.to(tl.int64) * stride_ot + head * HEAD_DIM + dims
    tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


def split_kv_attention(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous: at most one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D] contiguous
    v_cache: torch.Tensor,  # same shape
    block_tables: torch.Tensor,  # [B, W] int32, padded with the null block 0
    seq_lens: torch.Tensor,  # [B] int32, contiguous
    query_start_loc: torch.Tensor,  # [B + 1] int32, contiguous
    scale: float,
    splits: int,
    out: torch.Tensor,  # [T, Hq * D] in q's dtype, last dim contiguous
) -> torch.Tensor:
    """Decode attention (at most one query per sequence, the sequence's last token) with each
    sequence's keys split into `splits` parts (1..MAX_SPLITS); writes and returns `out`. The
    arguments are those `attention.paged_attention` checked; it calls this when `num_splits` says."""
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, got {splits}")
    num_seqs = block_tables.shape[0]
    _, hq, head_dim = q.shape
    _, hkv, block_size, _ = k_cache.shape
    group = hq // hkv
    block_d = dim_tile(head_dim)
    block_n = key_tile(q.dtype)
    # Allocated per call, as `out` and the LoRA intermediate are: inside a captured step the
    # allocation comes from the graph's pool, at the same address every replay.
    partial = torch.empty((num_seqs, hq, splits, head_dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((num_seqs, hq, splits, 2), dtype=torch.float32, device=q.device)
    _partial_kernel[(num_seqs, hkv, splits)](
        q,
        k_cache,
        v_cache,
        partial,
        stats,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        splits,
        hq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_M=max(triton.next_power_of_2(group), 16),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        **dot_flags(q),
        num_warps=4,
        num_stages=2,
    )
    _combine_kernel[(num_seqs, hq)](
        partial,
        stats,
        out,
        seq_lens,
        query_start_loc,
        splits,
        hq,
        out.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=MAX_SPLITS,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out
