"""Decode attention split over keys (`kernels/triton/split_kv.py`) against the torch reference, and
when `paged_attention` takes it.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py), so the long contexts
keep few heads and a small head dim. Most tests call `split_kv_attention` with a split count of
their own, to put the split boundaries where they want them; the last ones go through
`paged_attention` and its choice.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels.triton import split_kv
from libs.engine.kernels.triton.attention import paged_attention
from libs.engine.kernels.triton.split_kv import MAX_SPLITS, num_splits, split_kv_attention
from tests.helpers.paged_batch import DEVICE, PAD, SCALE, Batch

H100_SMS = 132


def split(batch: Batch, splits: int) -> torch.Tensor:
    """split_kv_attention on DEVICE with `splits` parts per sequence, the result on the CPU."""
    out = torch.empty(
        batch.q.shape[0], batch.q.shape[1] * batch.q.shape[2], dtype=batch.q.dtype, device=DEVICE
    )
    return split_kv_attention(*batch.tensors(), SCALE, splits, out).cpu()


def decodes(*seq_lens: int) -> list[tuple[int, int]]:
    return [(1, n) for n in seq_lens]


@pytest.mark.parametrize("context", [1, 2, 31, 32, 33, 255, 1000, 4096, 8192])
def test_matches_the_reference_at_contexts_from_one_token_to_8k(context):
    # float32's 32-key tiles: lengths around one tile, and contexts that fill all 8 splits.
    batch = Batch(decodes(context), hq=2, hkv=1, d=16, seed=context)
    batch.check(split(batch, 8))


@pytest.mark.parametrize("splits", [1, 2, 3, 7, MAX_SPLITS])
def test_any_split_count_gives_the_same_attention(splits):
    batch = Batch(decodes(1000, 77), seed=splits)
    batch.check(split(batch, splits))


@pytest.mark.parametrize("hq", [2, 4, 6, 8, 16])
def test_query_heads_share_their_kv_head(hq):
    # Groups of 1, 2, 3 (not a power of two), 4 and 8 query heads over each of 2 KV heads.
    batch = Batch(decodes(300, 45), hq=hq, hkv=2, seed=hq)
    batch.check(split(batch, 4))


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_other_block_sizes(block_size):
    # Split lengths are whole key tiles, not whole cache blocks: splits start mid-block at 8.
    batch = Batch(decodes(700, 130), block_size=block_size, seed=block_size)
    batch.check(split(batch, 6))


def test_sequences_of_very_different_lengths_in_one_batch():
    # 3 keys fill less than one split (its other splits have no key); 2,000 fill all eight; padding
    # rows are one-token sequences on the null block, as in a captured graph.
    batch = Batch([(1, 3), (1, 2000), PAD, (1, 40), (1, 257), PAD, (1, 1)], hq=4, hkv=2, seed=20)
    batch.check(split(batch, 8))


def test_a_sequence_without_a_query_writes_no_row():
    # Sequences 1 and 3 have no query this step. Their first row would be the next sequence's (row 1)
    # and one past the output (row 2, a sentinel here).
    batch = Batch([(1, 90), (0, 50), (1, 60), (0, 40)], seed=21)
    rows = torch.full((3, 4 * 16), float("nan"), device=DEVICE)
    split_kv_attention(*batch.tensors(), SCALE, 4, rows[:2])
    assert rows[2].isnan().all()
    batch.check(rows[:2].cpu())


@pytest.mark.parametrize("d", [24, 64, 128])
def test_model_head_dims_and_one_not_a_power_of_two(d):
    batch = Batch(decodes(600), hq=4, hkv=1, d=d, seed=d)
    batch.check(split(batch, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_matches_the_float32_reference(dtype):
    # 64-key tiles in 16-bit: a 3,000-token context over 16 splits, a short one, padding.
    batch = Batch([*decodes(3000, 70), PAD], hq=8, hkv=2, d=32, dtype=dtype, seed=22)
    batch.check(split(batch, 16))


def test_a_split_count_past_the_combine_tile_is_refused():
    batch = Batch(decodes(10))
    with pytest.raises(ValueError, match="splits"):
        split(batch, MAX_SPLITS + 1)


def test_small_decode_batches_with_long_contexts_split():
    assert num_splits(1, 8, 1, 8192, H100_SMS) == 16  # 8 programs become 128 of the 132 SMs'
    assert num_splits(4, 2, 1, 8192, H100_SMS) == 16
    assert num_splits(1, 1, 1, 100_000, H100_SMS) == MAX_SPLITS


def test_batches_that_fill_the_gpu_do_not_split():
    assert num_splits(64, 8, 1, 8192, H100_SMS) == 1
    assert num_splits(16, 8, 1, 8192, H100_SMS) == 1  # 128 programs: one wave already
    assert num_splits(9, 8, 1, 8192, H100_SMS) == 1  # 72: a split would make a second, partial wave


def test_short_contexts_do_not_split():
    assert num_splits(1, 8, 1, 511, H100_SMS) == 1
    assert num_splits(1, 8, 1, 512, H100_SMS) == 2


def test_prefill_and_mixed_steps_do_not_split():
    assert num_splits(1, 8, 2, 8192, H100_SMS) == 1
    assert num_splits(1, 8, 512, 8192, H100_SMS) == 1


def test_paged_attention_takes_the_split_for_a_long_decode_at_batch_one():
    batch = Batch(decodes(4000), hq=4, hkv=2, seed=23)
    splits = num_splits(1, 2, 1, batch.max_seq_len, split_kv.multiprocessors(torch.device(DEVICE)))
    assert splits > 1
    got = batch.run()
    assert torch.equal(got, split(batch, splits))
    # max_seq_len only picks the path (the kernels read the lengths on the device), so 1 forces the
    # single pass: it sums the same terms in another order, so its last bits differ.
    assert not torch.equal(got, batch.run(max_seq_len=1))
    batch.check(got)


def test_a_captured_graphs_max_model_len_keeps_short_contexts_right():
    # A captured decode step is given max_model_len, not the real lengths: the split count is the
    # long context's, and every real sequence is far shorter than its splits.
    batch = Batch([(1, 5), PAD, (1, 300), (1, 33)], hq=4, hkv=1, seed=24)
    sms = split_kv.multiprocessors(torch.device(DEVICE))
    assert num_splits(4, 1, 1, 8192, sms) > 1
    batch.check(batch.run(max_seq_len=8192))


def test_a_given_out_buffer_is_written_in_place_and_returned():
    batch = Batch(decodes(2000, 600), seed=25)
    out = torch.full((2, 4 * 16), float("nan"), device=DEVICE)
    got = paged_attention(*batch.tensors(), SCALE, 1, batch.max_seq_len, out=out)
    assert got is out
    batch.check(out.cpu())
