"""The Triton paged-attention kernel against the torch reference (`TorchOps.attention`).

Without a GPU it runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so the batches stay small. Every cache slot holds random values, so a key read
from the wrong block or offset shows in the output.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels import AttentionMetadata, TorchOps
from libs.engine.kernels.triton.attention import paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3
PAD = (1, 1)  # a padding row: one query, one token, a block table row of null blocks
TOLERANCE = {  # (rtol, atol) against the float32 reference on the same (rounded) inputs
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}


class Batch:
    """Random queries and caches for sequences given as (q_len, seq_len), blocks in shuffled order."""

    def __init__(self, seqs, *, hq=4, hkv=2, d=16, block_size=16, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        blocks = [0 if seq is PAD else -(-seq[1] // block_size) for seq in seqs]
        # Block 0 is the null block; two spare blocks are never referenced.
        num_blocks = 1 + sum(blocks) + 2
        physical = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.block_tables = torch.zeros(len(seqs), max(blocks) + 1, dtype=torch.int32)
        for b, n in enumerate(blocks):
            self.block_tables[b, :n] = torch.tensor(physical[:n], dtype=torch.int32)
            physical = physical[n:]
        q_lens = torch.tensor([q_len for q_len, _ in seqs], dtype=torch.int32)
        self.seq_lens = torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32)
        self.query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        self.query_start_loc[1:] = q_lens.cumsum(0)
        self.max_query_len = int(q_lens.max())
        t = int(self.query_start_loc[-1])
        # q is a view into a fused qkv projection, as the runner hands it over: rows are strided.
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        self.q = qkv[:, : hq * d].view(t, hq, d)
        self.k_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
        self.v_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
        self.block_size = block_size

    def run(self, max_query_len: int | None = None) -> torch.Tensor:
        tensors = (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)
        return _attend(*tensors, max_query_len=max_query_len or self.max_query_len)

    def reference(self) -> torch.Tensor:
        """TorchOps.attention in float32 on the (already rounded) inputs."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=torch.zeros(self.q.shape[0], dtype=torch.int64),  # attention does not read it
            max_query_len=self.max_query_len,
            max_seq_len=int(self.seq_lens.max()),
            block_size=self.block_size,
        )
        return TorchOps().attention(self.q.float(), self.k_cache.float(), self.v_cache.float(), meta, SCALE)

    def check(self, got: torch.Tensor | None = None) -> None:
        got = self.run() if got is None else got
        assert got.shape == (self.q.shape[0], self.q.shape[1] * self.q.shape[2])
        assert got.dtype == self.q.dtype
        rtol, atol = TOLERANCE[self.q.dtype]
        torch.testing.assert_close(got.float(), self.reference(), rtol=rtol, atol=atol)


def _attend(*tensors: torch.Tensor, max_query_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention on DEVICE, the result back on the CPU."""
    on_device = [x.to(DEVICE) for x in tensors]
    return paged_attention(*on_device, SCALE, max_query_len, out=out).cpu()


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
    got = paged_attention(*(x.to(DEVICE) for x in tensors), SCALE, batch.max_query_len, out=out)
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
        )
