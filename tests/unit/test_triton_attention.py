"""The Triton paged-attention kernel against the torch reference (`TorchOps.attention`).

Without a GPU it runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so the batches stay small. Every context here is shorter than a split over keys
needs (`split_kv.MIN_KEYS_PER_SPLIT`), so these are the single-pass kernel's tests; the split's are
in test_triton_split_kv.py.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels.triton.attention import paged_attention
from tests.helpers.paged_batch import DEVICE, PAD, SCALE, Batch


def _attend(
    *tensors: torch.Tensor, max_query_len: int, max_seq_len: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """paged_attention on DEVICE, the result back on the CPU."""
    on_device = [x.to(DEVICE) for x in tensors]
    return paged_attention(*on_device, SCALE, max_query_len, max_seq_len, out=out).cpu()


def test_keys_are_read_through_a_shuffled_block_table():
    batch = Batch([(5, 40), (1, 70), (12, 12)], seed=1)
    tables = batch.block_tables[:, :3].flatten()
    assert not torch.equal(tables, tables.sort().values)
    batch.check()


@pytest.mark.parametrize("hq", [2, 4, 8, 16])
def test_query_heads_share_their_kv_head(hq):
    # Group sizes 1, 2, 4 and 8: queries and heads share the tile's rows.
    Batch([(1, 30), (7, 25), (3, 3)], hq=hq, hkv=2, seed=hq).check()


def test_group_size_not_a_power_of_two():
    Batch([(1, 30), (6, 25)], hq=6, hkv=2, seed=2).check()


def test_lengths_off_the_block_and_tile_boundaries():
    # 64-key tiles over 16-token blocks: lengths just around both, and prefixes that end mid-block.
    Batch([(1, 1), (1, 15), (2, 17), (3, 33), (1, 63), (4, 65), (7, 97)], seed=3).check()


def test_decode_only_batch():
    Batch([(1, 1), (1, 16), (1, 31), (1, 80), (1, 5)], hq=8, hkv=2, seed=4).check()


def test_prefill_from_an_empty_cache():
    # 70 queries with 4 heads in 2 KV groups take two 32-query programs and a partial third.
    Batch([(70, 70), (9, 9), (1, 1)], seed=5).check()


def test_chunk_after_a_cached_prefix():
    # Each chunk's first query sees the whole prefix; the causal mask starts mid-block.
    Batch([(24, 61), (16, 48), (5, 100)], seed=6).check()


def test_mixed_batch_of_decodes_prefills_chunks_and_padding():
    Batch([(1, 50), (33, 33), (1, 1), (10, 45), PAD, (1, 17), (40, 72), PAD], hq=8, hkv=2, seed=7).check()


def test_padding_rows_do_not_change_other_rows():
    batch = Batch([(3, 20), PAD, (1, 33), PAD, PAD], seed=8)
    got = batch.run()
    rows = torch.tensor([0, 1, 2, 4])  # the real sequences' queries
    torch.testing.assert_close(got[rows], batch.reference()[rows], rtol=1e-5, atol=1e-5)
    real = torch.tensor([0, 2])
    alone = _attend(
        batch.q[rows],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[real],
        batch.seq_lens[real],
        torch.tensor([0, 3, 4], dtype=torch.int32),
        max_query_len=3,
        max_seq_len=33,
    )
    assert torch.equal(alone, got[rows])


def test_a_larger_max_query_len_adds_only_programs_that_exit():
    # A graph captured for a longer step launches query blocks past every sequence's q_len; they must
    # write nothing (rows past a sequence's q_len belong to the next one).
    batch = Batch([(1, 40), (3, 9), (2, 2)], seed=9)
    batch.check(batch.run(max_query_len=200))


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    Batch([(1, 45), (20, 20), (6, 39)], block_size=block_size, seed=10).check()


@pytest.mark.parametrize("d", [64, 128])
def test_model_head_dims(d):
    Batch([(1, 37), (9, 9), (4, 22)], hq=4, hkv=1, d=d, seed=d).check()


def test_head_dim_not_a_power_of_two():
    Batch([(1, 37), (5, 21)], d=24, seed=11).check()


def test_float32_matches_the_reference_tightly():
    batch = Batch([(1, 37), (8, 40), (17, 17)], hq=8, hkv=2, d=32, seed=12)
    torch.testing.assert_close(batch.run(), batch.reference(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_matches_the_float32_reference(dtype):
    Batch([(1, 37), (8, 40), (17, 17), PAD], hq=8, hkv=2, d=32, dtype=dtype, seed=13).check()


def test_a_given_out_buffer_is_written_in_place_and_returned():
    batch = Batch([(1, 30), (6, 6)], seed=14)
    tensors = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
    )
    out = torch.full((7, 4 * 16), float("nan"), device=DEVICE)
    got = paged_attention(
        *(x.to(DEVICE) for x in tensors), SCALE, batch.max_query_len, batch.max_seq_len, out=out
    )
    assert got is out
    batch.check(out.cpu())


def test_mismatched_heads_are_rejected():
    batch = Batch([(1, 5)], hq=4, hkv=2)
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention(
            batch.q[:, :3],
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            SCALE,
            1,
            5,
        )
