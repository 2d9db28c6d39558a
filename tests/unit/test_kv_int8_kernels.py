"""The 8-bit KV cache (EXPERT_KV_CACHE_DTYPE=int8): the native kernels write the bytes the torch
reference writes, read them within a stated tolerance of float attention, and keep a row's output
independent of its batch."""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels import AttentionMetadata, HeadLayout
from libs.engine.kernels.build import load
from libs.engine.kernels.reference import dequantize_kv_rows, quantize_kv_rows

needs_native = pytest.mark.skipif(not load(), reason="native kernels did not build on this machine")

# Attention over int8 K and V against attention over the float K and V they came from, for
# standard-normal keys, values and queries: each element is off by at most max|row| / 254 (about
# 1 % of the row's largest), and the outputs (softmax-weighted means of values) stay within this.
# Measured worst case over these tests: about 0.02.
INT8_ATOL = 0.05


def _metadata(q_lens, seq_lens, tables, block_size):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def _caches(g, num_blocks, hkv, block_size, d):
    """A float K and V pool and the int8 pool quantized from it."""
    k, v = (torch.randn(num_blocks, hkv, block_size, d, generator=g) for _ in range(2))
    return (k, v), (quantize_kv_rows(k), quantize_kv_rows(v))


def test_rows_round_trip_within_half_a_step():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    x[7, 1] = 0.0  # an all-zero row keeps a zero scale and zero codes
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    back = dequantize_kv_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert torch.equal(back[7, 1], torch.zeros(64))
    # the largest element of each row is stored exactly as +-127 codes
    assert int(rows[..., :64].abs().amax()) == 127


@needs_native
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_write_the_references_bytes(native, ref, qk_norm):
    g = torch.Generator().manual_seed(3)
    heads = HeadLayout(num_heads=4, num_kv_heads=2, head_dim=32)
    t = 11
    qkv = torch.randn(t, (4 + 4) * 32, generator=g) * 3
    positions = torch.randint(0, 60, (t,), generator=g)
    table = torch.randn(64, 32, generator=g)
    slots = torch.randperm(5 * 8, generator=g)[:t]
    slots[3] = -1
    qn = torch.randn(32, generator=g) if qk_norm else None
    kn = torch.randn(32, generator=g) if qk_norm else None
    caches = [torch.zeros(5, 2, 8, 36, dtype=torch.int8) for _ in range(4)]
    q_ref = ref.rope_and_cache(qkv, positions, table, caches[0], caches[1], slots, heads, qn, kn, 1e-6)
    q_nat = native.rope_and_cache(qkv, positions, table, caches[2], caches[3], slots, heads, qn, kn, 1e-6)
    torch.testing.assert_close(q_nat, q_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[3], caches[1])  # values: the same float input, the same roundings
    if not qk_norm:  # keys: the kernel's rotation equals torch's bitwise only without the norm
        assert torch.equal(caches[2], caches[0])
    else:
        codes_differ = (caches[2][..., :32].int() - caches[0][..., :32].int()).abs()
        assert int(codes_differ.max()) <= 1


@needs_native
@pytest.mark.parametrize(("head_dim", "hq", "hkv"), [(16, 6, 2), (64, 9, 3), (128, 4, 4), (32, 8, 1)])
def test_int8_attention_matches_the_float_reference(native, ref, head_dim, hq, hkv):
    g = torch.Generator().manual_seed(head_dim + hq)
    block_size = 16
    (kf, vf), (kq, vq) = _caches(g, 48, hkv, block_size, head_dim)
    # a decode over 37 keys, a fresh 13-token prefill, a 5-token chunk after a 32-token cached
    # prefix, a one-token sequence; block tables drawn at random
    q_lens, seq_lens = [1, 13, 5, 1], [37, 13, 37, 1]
    order = torch.randperm(47, generator=g).add(1).tolist()
    tables = [order[0:3], order[3:4], order[4:7], order[7:8]]
    meta = _metadata(q_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=g)
    scale = head_dim**-0.5
    got = native.attention(q, kq, vq, meta, scale)
    # the same int8 cache read by the reference (dequantized, then torch's attention): rounding only
    torch.testing.assert_close(got, ref.attention(q, kq, vq, meta, scale), rtol=1e-4, atol=1e-5)
    # against attention over the float cache the int8 was made from: quantization error
    float_out = ref.attention(q, kf, vf, meta, scale)
    torch.testing.assert_close(got, float_out, rtol=0, atol=INT8_ATOL)
    assert float((got - float_out).abs().mean()) < INT8_ATOL / 5


@needs_native
def test_int8_attention_rows_are_bitwise_independent_of_the_batch(native):
    g = torch.Generator().manual_seed(7)
    block_size, hq, hkv, d = 16, 9, 3, 64
    _, (k_cache, v_cache) = _caches(g, 64, hkv, block_size, d)
    table = [4, 8, 15, 16, 23, 42]
    q = torch.randn(90, hq, d, generator=g)
    full = native.attention(q, k_cache, v_cache, _metadata([90], [90], [table], block_size), 0.125)
    other = torch.randn(3, hq, d, generator=g)
    meta = _metadata([3, 1], [40, 90], [[1, 2, 3], table], block_size)
    mixed = native.attention(torch.cat([other, q[89:90]]), k_cache, v_cache, meta, 0.125)
    assert torch.equal(mixed[3], full[89])
    chunk = native.attention(q[40:70], k_cache, v_cache, _metadata([30], [70], [table], block_size), 0.125)
    assert torch.equal(chunk, full[40:70])


@needs_native
def test_a_cache_written_in_chunks_equals_one_written_at_once(native):
    """Per-row scales: appending to a partly filled block never changes the rows already there, so
    a prompt cached in chunks (or recomputed after preemption) holds the same bytes."""
    g = torch.Generator().manual_seed(11)
    heads = HeadLayout(num_heads=6, num_kv_heads=2, head_dim=64)
    t = 40
    qkv = torch.randn(t, (6 + 4) * 64, generator=g)
    positions = torch.arange(t)
    table = torch.randn(64, 64, generator=g)
    slots = torch.arange(16, 16 + t)  # blocks 1-3, the last one partly filled
    whole = [torch.zeros(4, 2, 16, 68, dtype=torch.int8) for _ in range(2)]
    native.rope_and_cache(qkv, positions, table, *whole, slots, heads, None, None, 1e-6)
    chunked = [torch.zeros(4, 2, 16, 68, dtype=torch.int8) for _ in range(2)]
    for start, end in ((0, 7), (7, 8), (8, 29), (29, 40)):
        native.rope_and_cache(
            qkv[start:end], positions[start:end], table, *chunked, slots[start:end], heads, None, None, 1e-6
        )
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])


@needs_native
def test_attention_refuses_mismatched_caches(native):
    q = torch.randn(1, 2, 32)
    meta = _metadata([1], [1], [[1]], 4)
    k = torch.zeros(2, 1, 4, 36, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="both be float32 or both int8"):
        native.attention(q, k, torch.zeros(2, 1, 4, 32), meta, 1.0)
    with pytest.raises(RuntimeError, match="head layout mismatch"):
        unscaled = torch.zeros(2, 1, 4, 32, dtype=torch.int8)  # no room for the rows' scales
        native.attention(q, unscaled, unscaled.clone(), meta, 1.0)
