"""Attention kernels side by side on one GPU (a section of bench/gpu.py): our paged Triton kernel,
which reads the KV cache through the block table; the torch reference operator, which gathers every
sequence's blocks into a padded batch and calls `scaled_dot_product_attention`; and that same
`scaled_dot_product_attention` on keys and values already contiguous (the dense floor: what an
attention kernel costs when nothing is paged). Llama-3.2-1B's attention shape (32 query heads, 8 KV
heads, head dim 64) in bfloat16, 16-token blocks scattered over the cache.

- decode: 64 sequences of 256 tokens, one query each;
- chunk: 4 sequences with 384 tokens cached and a 128-token chunk each.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16


def _case(batch: int, context: int, queries: int, device: torch.device, dtype: torch.dtype, seed: int):
    """q, caches, metadata for `batch` sequences of `context` cached tokens plus `queries` new ones."""
    from libs.engine.kernels import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    length = context + queries
    per_seq = -(-length // BLOCK)
    num_blocks = batch * per_seq + 1
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is the null block
    tables = order[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    cache = torch.randn(2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(batch * queries, HEADS, HEAD_DIM, generator=g).to(dtype)
    qsl = torch.arange(0, batch * queries + 1, queries, dtype=torch.int32)
    seq_lens = torch.full((batch,), length, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.zeros(batch * queries, dtype=torch.int64, device=device),
        max_query_len=queries,
        max_seq_len=length,
        block_size=BLOCK,
    )
    return q.to(device), cache[0].to(device), cache[1].to(device), meta


def _time(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median microseconds of `run`, after a warm-up (CUDA events on a GPU, the wall clock elsewhere)."""
    import time

    run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            began = time.perf_counter()
            run()
            samples.append((time.perf_counter() - began) * 1e6)
    return statistics.median(samples)


def attention_timings(device: torch.device, smoke: bool) -> dict[str, float]:
    """Microseconds per call of each kernel on each case."""
    dtype = torch.float32 if smoke else torch.bfloat16
    cases = (
        {"decode": (4, 24, 1), "chunk": (2, 24, 8)}
        if smoke
        else {"decode": (64, 256, 1), "chunk": (4, 384, 128)}
    )
    out: dict[str, float] = {}
    for name, (batch, context, queries) in cases.items():
        q, k_cache, v_cache, meta = _case(batch, context, queries, device, dtype, seed=len(name))
        timings = _one_case(q, k_cache, v_cache, meta, batch, queries, device, repeats=2 if smoke else 20)
        out |= {f"attn_{name}_{kernel}_us": us for kernel, us in timings.items()}
    return out


def _one_case(q, k_cache, v_cache, meta, batch: int, queries: int, device, repeats: int) -> dict[str, float]:
    from libs.engine.kernels import TorchOps
    from libs.engine.kernels.triton.attention import paged_attention

    scale = HEAD_DIM**-0.5
    tables = meta.block_tables
    ours = _time(
        lambda: paged_attention(
            q, k_cache, v_cache, tables, meta.seq_lens, meta.query_start_loc, scale, queries, meta.max_seq_len
        ),
        device,
        repeats,
    )
    gathered = _time(lambda: TorchOps().attention(q, k_cache, v_cache, meta, scale), device, repeats)
    # The dense floor: the same keys and values laid out [B, Hkv, L, D] beforehand.
    keys = k_cache[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, -1, HEAD_DIM)
    values = v_cache[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, -1, HEAD_DIM)
    dense_q = q.view(batch, queries, HEADS, HEAD_DIM).transpose(1, 2)
    mask = None
    if queries > 1:  # causal within the chunk, everything cached before it visible
        length = keys.shape[2]
        position = torch.arange(queries, device=device)[:, None] + length - queries
        mask = torch.arange(length, device=device)[None, :] <= position
    dense = _time(
        lambda: F.scaled_dot_product_attention(
            dense_q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        ),
        device,
        repeats,
    )
    return {"ours": ours, "gather_sdpa": gathered, "dense_sdpa": dense}
