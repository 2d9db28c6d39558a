"""A batch of random queries over a random paged KV cache, and the torch reference's answer for it:
what the Triton attention tests (tests/unit/test_triton_attention.py, test_triton_split_kv.py)
check the kernels against.

Every cache slot holds random values and the blocks are handed out in shuffled order, so a key read
from the wrong block or offset shows in the output.
"""

from __future__ import annotations

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
        self.max_seq_len = int(self.seq_lens.max())
        t = int(self.query_start_loc[-1])
        # q is a view into a fused qkv projection, as the runner hands it over: rows are strided.
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        self.q = qkv[:, : hq * d].view(t, hq, d)
        self.k_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
        self.v_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
        self.block_size = block_size

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """q, k_cache, v_cache, block_tables, seq_lens, query_start_loc on DEVICE: the kernels'
        tensor arguments, in their order."""
        tensors = (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)
        return tuple(x.to(DEVICE) for x in tensors)

    def run(self, max_query_len: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
        """paged_attention on DEVICE with the batch's own bounds unless given; the result on the CPU."""
        return paged_attention(
            *self.tensors(),
            SCALE,
            max_query_len or self.max_query_len,
            max_seq_len or self.max_seq_len,
        ).cpu()

    def reference(self) -> torch.Tensor:
        """TorchOps.attention in float32 on the (already rounded) inputs."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=torch.zeros(self.q.shape[0], dtype=torch.int64),  # attention does not read it
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
        )
        return TorchOps().attention(self.q.float(), self.k_cache.float(), self.v_cache.float(), meta, SCALE)

    def check(self, got: torch.Tensor | None = None) -> None:
        got = self.run() if got is None else got
        assert got.shape == (self.q.shape[0], self.q.shape[1] * self.q.shape[2])
        assert got.dtype == self.q.dtype
        rtol, atol = TOLERANCE[self.q.dtype]
        torch.testing.assert_close(got.float(), self.reference(), rtol=rtol, atol=atol)
