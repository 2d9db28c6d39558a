"""Host memory placement: the weight arena and huge-page tensors."""

from __future__ import annotations

import torch

from libs.engine import host_memory
from libs.engine.host_memory import HUGE_PAGE, WeightArena


def test_the_arena_copies_tensors_one_after_another_on_cache_lines():
    arena = WeightArena(chunk_bytes=1 << 20)
    a = torch.arange(10, dtype=torch.float32)
    b = torch.randint(-128, 127, (3, 5), dtype=torch.int8)
    c = torch.randn(4, 4, dtype=torch.float16)
    copies = [arena.copy(t) for t in (a, b, c)]
    for original, copy in zip((a, b, c), copies, strict=True):
        assert torch.equal(copy, original) and copy.dtype == original.dtype and copy.is_contiguous()
        assert copy.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0  # a chunk starts on a huge page
    assert copies[1].data_ptr() - copies[0].data_ptr() == 64  # in the order they came, packed
    a.zero_()
    assert copies[0][3] == 3  # a copy, not a view of the original


def test_a_tensor_larger_than_a_chunk_gets_its_own_and_outlives_the_arena():
    arena = WeightArena(chunk_bytes=1 << 20)
    small = arena.copy(torch.ones(16))
    big = arena.copy(torch.full((3 << 20,), 7, dtype=torch.uint8))
    after = arena.copy(torch.ones(8))
    assert big.numel() == 3 << 20 and bool((big == 7).all())
    assert big.data_ptr() % HUGE_PAGE == 0 and big.data_ptr() != small.data_ptr()
    del arena
    assert small.sum() == 16 and after.sum() == 8 and int(big[-1]) == 7


def test_zeros_in_huge_pages():
    t = host_memory.zeros((2, 3, 5), torch.float32)
    assert t.shape == (2, 3, 5) and t.dtype == torch.float32 and not t.any()
    assert t.data_ptr() % HUGE_PAGE == 0
    t[1, 2, 4] = 1.5
    assert t.sum() == 1.5
