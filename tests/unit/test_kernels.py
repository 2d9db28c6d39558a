"""The native CPU kernels against the torch reference, and their batch invariance."""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels import AttentionMetadata, HeadLayout
from libs.engine.kernels.build import load

pytestmark = pytest.mark.skipif(not load(), reason="native kernels did not build on this machine")


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (37, 40), (16, 8), (100, 3)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 50, 130])
def test_linear_matches_torch(native, ref, n, k, rows):
    g = torch.Generator().manual_seed(n * k + rows)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    expected = ref.linear(x, ref.prepare_linear(w, b))
    got = native.linear(x, native.prepare_linear(w, b))
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_linear_results_are_bitwise_independent_of_the_batch(native):
    g = torch.Generator().manual_seed(0)
    w = native.prepare_linear(torch.randn(300, 576, generator=g))
    x = torch.randn(200, 576, generator=g)
    full = native.linear(x, w)
    for rows in (1, 2, 3, 5, 6, 7, 13, 48, 49, 97):
        assert torch.equal(native.linear(x[:rows], w), full[:rows]), rows
    assert torch.equal(native.linear(x[150:151], w), full[150:151])


def test_embedding_rows_of_a_packed_weight_are_its_rows(native, ref):
    # A tied LM head is also the embedding table: rows are read back out of the 16-column panels.
    w = torch.randn(77, 40, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([0, 76, 15, 16, 33, 15, 64])
    assert torch.equal(native.embedding(native.prepare_linear(w), ids), w[ids])
    assert torch.equal(ref.embedding(ref.prepare_linear(w), ids), w[ids])


def test_rms_norms_match_torch(native, ref):
    g = torch.Generator().manual_seed(1)
    x, r, w = (
        torch.randn(9, 100, generator=g),
        torch.randn(9, 100, generator=g),
        torch.randn(100, generator=g),
    )
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    expected_x, expected_r = ref.add_rms_norm(x, r, w, 1e-6)
    got_x, got_r = native.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    torch.testing.assert_close(got_r, expected_r)
    torch.testing.assert_close(got_x, expected_x, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_matches_torch(native, ref):
    x = torch.randn(5, 2 * 77, generator=torch.Generator().manual_seed(2)) * 8
    torch.testing.assert_close(native.silu_and_mul(x), ref.silu_and_mul(x), rtol=1e-5, atol=1e-6)


def _cache(num_blocks, hkv, block_size, d):
    return torch.zeros(num_blocks, hkv, block_size, d), torch.zeros(num_blocks, hkv, block_size, d)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_match_torch(native, ref, qk_norm):
    g = torch.Generator().manual_seed(3)
    heads = HeadLayout(num_heads=4, num_kv_heads=2, head_dim=32)
    t = 11
    qkv = torch.randn(t, (4 + 4) * 32, generator=g)
    positions = torch.randint(0, 60, (t,), generator=g)
    table = torch.randn(64, 32, generator=g)
    slots = torch.randperm(5 * 8, generator=g)[:t]
    slots[3] = -1
    qn = torch.randn(32, generator=g) if qk_norm else None
    kn = torch.randn(32, generator=g) if qk_norm else None
    kr, vr = _cache(5, 2, 8, 32)
    kn_, vn_ = _cache(5, 2, 8, 32)
    q_ref = ref.rope_and_cache(qkv, positions, table, kr, vr, slots, heads, qn, kn, 1e-6)
    q_nat = native.rope_and_cache(qkv, positions, table, kn_, vn_, slots, heads, qn, kn, 1e-6)
    torch.testing.assert_close(q_nat, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kn_, kr, rtol=1e-5, atol=1e-5)
    assert torch.equal(vn_, vr)


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


@pytest.mark.parametrize(
    ("head_dim", "hq", "hkv"), [(16, 6, 2), (64, 6, 2), (128, 6, 2), (64, 4, 4), (32, 80, 1)]
)
def test_paged_attention_matches_torch_on_a_mixed_batch(native, ref, head_dim, hq, hkv):
    # grouped-query, multi-head (one query head per KV head) and multi-query with many heads
    g = torch.Generator().manual_seed(head_dim)
    block_size = 4
    k_cache, v_cache = (
        torch.randn(40, hkv, block_size, head_dim, generator=g),
        torch.randn(40, hkv, block_size, head_dim, generator=g),
    )
    # a decode (1 query over 10 keys), a fresh prefill (7 over 7), a chunk (5 over 13)
    q_lens, seq_lens = [1, 7, 5], [10, 7, 13]
    tables = [[3, 9, 1], [20, 21], [5, 6, 7, 30]]
    meta = _metadata(q_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=g)
    scale = head_dim**-0.5
    expected = ref.attention(q, k_cache, v_cache, meta, scale)
    got = native.attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_paged_attention_rows_are_bitwise_independent_of_the_batch(native):
    g = torch.Generator().manual_seed(7)
    block_size, hq, hkv, d = 16, 9, 3, 64
    k_cache, v_cache = (
        torch.randn(64, hkv, block_size, d, generator=g),
        torch.randn(64, hkv, block_size, d, generator=g),
    )
    table = [4, 8, 15, 16, 23, 42]
    q = torch.randn(90, hq, d, generator=g)
    # the whole sequence as one 90-token prefill ...
    full = native.attention(q, k_cache, v_cache, _metadata([90], [90], [table], block_size), 0.125)
    # ... as a decode of its last token next to an unrelated sequence ...
    other = torch.randn(3, hq, d, generator=g)
    meta = _metadata([3, 1], [40, 90], [[1, 2, 3], table], block_size)
    mixed = native.attention(torch.cat([other, q[89:90]]), k_cache, v_cache, meta, 0.125)
    assert torch.equal(mixed[3], full[89])
    # ... and as a 30-token chunk in the middle
    chunk = native.attention(q[40:70], k_cache, v_cache, _metadata([30], [70], [table], block_size), 0.125)
    assert torch.equal(chunk, full[40:70])


def test_argmax_is_torchs_on_every_row(native):
    g = torch.Generator().manual_seed(0)
    nan, inf = float("nan"), float("inf")
    special = torch.randn(8, 257, generator=g)
    special[0, 100] = special[0, 200] = nan  # the first NaN wins, even over a larger value
    special[1, 5] = special[1, 7] = inf  # the first infinity
    special[2, 256] = nan  # in the tail the vector pass leaves over
    special[3, :] = -inf
    special[3, 250] = 0.0  # a masked row: one allowed token
    special[5, 0] = special[5, 256] = 50.0  # ties: the first index
    cases = [
        torch.randn(32, 49152, generator=g),
        torch.randint(0, 3, (16, 1000), generator=g).float(),  # many ties
        torch.randn(7, 33, generator=g),
        torch.randn(3, 5, generator=g),  # shorter than one vector pass
        torch.full((2, 100), -inf),
        special,
    ]
    for logits in cases:
        assert torch.equal(native.argmax(logits), logits.argmax(dim=-1)), logits.shape
