"""The Triton LoRA (shrink + expand) and IA³ kernels against the torch reference: under the
interpreter on the CPU, compiled on a GPU when there is one (the reference always runs on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from libs.engine.adapters.batch import Entries
from libs.engine.adapters.device import PAGE_ROWS
from libs.engine.kernels import Ia3Slice, LoraSlice
from libs.engine.kernels.triton import unavailable_reason
from libs.engine.kernels.triton.lora import ia3_scale, lora_apply

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    unavailable_reason(DEVICE.type) is not None, reason=str(unavailable_reason(DEVICE.type))
)

NAN_PAGE = 15  # a pool page (and IA³ slot) full of NaN that no real entry uses: reading it shows


@dataclass
class Batch:
    """One description as both the kernels' CSR tensors and the reference's Python lists."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    token_ranges: list[tuple[int, int]]
    entries: Entries
    max_query_len: int
    max_entries: int

    @property
    def num_tokens(self) -> int:
        return self.token_ranges[-1][1]

    def rows_without_entries(self) -> list[int]:
        return [
            t
            for (s, e), seq in zip(self.token_ranges, self.entries.per_seq, strict=True)
            if not seq
            for t in range(s, e)
        ]


def _batch(lens: list[int], per_seq: list[list[tuple[int, int, float]]], garbage: int = 0) -> Batch:
    """Sequences of `lens` tokens with their (index, count, weight) entries; `garbage` more entries
    past the real ones (pointing at the NaN page, weight NaN) and as many extra entry_ptr rows."""
    ends = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ends.to(torch.int32)])
    flat = [e for seq in per_seq for e in seq] + [(NAN_PAGE * PAGE_ROWS, PAGE_ROWS, float("nan"))] * garbage
    counts = torch.tensor([len(seq) for seq in per_seq] + [1] * garbage, dtype=torch.int32)
    entry_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
    entries = Entries(
        entry_ptr=entry_ptr,
        index=torch.tensor([e[0] for e in flat], dtype=torch.int32),
        count=torch.tensor([e[1] for e in flat], dtype=torch.int32),
        scale=torch.tensor([e[2] for e in flat], dtype=torch.float32),
        per_seq=per_seq,
    )
    ranges = [(int(qsl[b]), int(qsl[b + 1])) for b in range(len(lens))]
    return Batch(qsl, ranges, entries, max(lens), max(len(seq) for seq in per_seq) + garbage)


def _lora(page: int, rank: int, weight: float = 1.0) -> list[tuple[int, int, float]]:
    """A LoRA's entries as the step's adapter batch lists them: one per page of 8 rows from `page` on."""
    return [
        ((page + i) * PAGE_ROWS, min(PAGE_ROWS, rank - i * PAGE_ROWS), weight)
        for i in range(-(-rank // PAGE_ROWS))
    ]


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies on the kernels' device (always copies, so the kernels never write a caller's tensor)."""
    return [t.clone().to(DEVICE) for t in tensors]


def _pools(k: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [16 pages * 8, k] and Bt [16 pages * 8, n], the last page NaN."""
    g = torch.Generator().manual_seed(seed)
    rows = (NAN_PAGE + 1) * PAGE_ROWS
    a = torch.randn(rows, k, generator=g) / k**0.5
    bt = torch.randn(rows, n, generator=g) * 0.5
    a[NAN_PAGE * PAGE_ROWS :] = float("nan")
    bt[NAN_PAGE * PAGE_ROWS :] = float("nan")
    return a.to(dtype), bt.to(dtype)


def _run_lora(
    ref, batch: Batch, k: int, n: int, *, dtype=torch.float32, pool_dtype=None, offset=0, padding=0, seed=0
):
    """(y before, y from the kernels, y from the reference) for one batch; `padding` token rows past
    the last sequence's (as in a padded CUDA-graph batch)."""
    a, bt = _pools(k, n, pool_dtype or dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch.num_tokens + padding, k, generator=g).to(dtype)
    y = torch.randn(batch.num_tokens + padding, offset + n + 5, generator=g).to(dtype)
    expected = y.clone()
    ref_slices = [LoraSlice(a, bt, offset, batch.entries)]
    ref.lora_apply(expected, x, ref_slices, batch.query_start_loc, batch.token_ranges)
    e = batch.entries
    got, *inputs = _on_device(y, x, a, bt, batch.query_start_loc, e.entry_ptr, e.index, e.count, e.scale)
    x_d, a_d, bt_d, qsl, entry_ptr, index, count, scale = inputs
    lora_apply(
        got,
        x_d,
        a_d,
        bt_d,
        offset,
        qsl,
        entry_ptr,
        index,
        count,
        scale,
        batch.max_query_len,
        batch.max_entries,
    )
    return y, got.cpu(), expected


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


def test_lora_mixed_adapters_leave_rows_without_entries_bit_identical(ref):
    per_seq = [_lora(0, 8), [], _lora(2, 16), [], _lora(5, 4), _lora(0, 8)]
    batch = _batch([3, 4, 1, 1, 6, 1], per_seq)
    y, got, expected = _run_lora(ref, batch, 96, 64, offset=7)
    _close(got, expected, torch.float32)
    rows = batch.rows_without_entries()
    assert torch.equal(got[rows], y[rows])
    assert torch.equal(got[:, :7], y[:, :7]) and torch.equal(got[:, 7 + 64 :], y[:, 7 + 64 :])


def test_lora_sums_several_weighted_entries_of_one_sequence(ref):
    batch = _batch([5, 1], [_lora(0, 8, 0.7) + _lora(3, 16, 0.3), _lora(3, 16, 0.3) + _lora(0, 8, 0.7)])
    _, got, expected = _run_lora(ref, batch, 64, 96)
    _close(got, expected, torch.float32)


def test_lora_multi_page_ranks_and_partial_pages(ref):
    # rank 16 = two full pages, rank 4 = one page with 4 rows, rank 12 = a full page and 4 rows
    batch = _batch([2, 3, 1], [_lora(0, 16), _lora(4, 4), _lora(8, 12)])
    _, got, expected = _run_lora(ref, batch, 64, 96)
    _close(got, expected, torch.float32)


def test_lora_decode_only_batch(ref):
    per_seq = [_lora(i % 4 * 2, 4 + 3 * i, 0.5 + 0.1 * i) for i in range(5)] + [[]]
    batch = _batch([1] * 6, per_seq)
    y, got, expected = _run_lora(ref, batch, 576, 960)
    _close(got, expected, torch.float32)
    assert torch.equal(got[5], y[5])


def test_lora_prefill_and_decode_mixed(ref):
    batch = _batch([37, 1, 20, 1], [_lora(0, 16), _lora(2, 8), [], _lora(3, 4, 0.5) + _lora(0, 16, 0.5)])
    y, got, expected = _run_lora(ref, batch, 576, 960)
    _close(got, expected, torch.float32)
    assert torch.equal(got[38:58], y[38:58])


def test_lora_never_reads_entries_past_a_sequences_last(ref):
    # The tail of index / count / scale and of entry_ptr is garbage pointing at a NaN page, and
    # token rows past the last sequence belong to no sequence.
    batch = _batch([4, 1, 2], [_lora(0, 8), [], _lora(1, 12, 0.6)], garbage=3)
    assert batch.entries.index.shape[0] > sum(len(s) for s in batch.entries.per_seq)
    y, got, expected = _run_lora(ref, batch, 64, 96, padding=2)
    _close(got, expected, torch.float32)
    assert torch.equal(got[4], y[4])
    assert torch.equal(got[7:], y[7:])


@pytest.mark.parametrize(("k", "n"), [(8192, 64), (1536, 2048)])
def test_lora_float32_matches_reference_at_model_widths(ref, k, n):
    batch = _batch([2, 1], [_lora(0, 16, 0.7) + _lora(4, 4, 0.3), _lora(6, 8)])
    _, got, expected = _run_lora(ref, batch, k, n, offset=n)
    _close(got, expected, torch.float32)


def test_lora_reads_strided_x_rows(ref):
    batch = _batch([3, 1], [_lora(0, 8), _lora(1, 4)])
    a, bt = _pools(64, 96, torch.float32, 3)
    fused = torch.randn(batch.num_tokens, 64 + 32)  # x is a column slice of a wider activation
    x = fused[:, 32:]
    y = torch.randn(batch.num_tokens, 96)
    expected = y.clone()
    ref.lora_apply(
        expected, x, [LoraSlice(a, bt, 0, batch.entries)], batch.query_start_loc, batch.token_ranges
    )
    e = batch.entries
    got, wide, *inputs = _on_device(
        y, fused, a, bt, batch.query_start_loc, e.entry_ptr, e.index, e.count, e.scale
    )
    a_d, bt_d, qsl, entry_ptr, index, count, scale = inputs
    lora_apply(got, wide[:, 32:], a_d, bt_d, 0, qsl, entry_ptr, index, count, scale, 3, 1)
    _close(got.cpu(), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pool_is_float32", [False, True])
def test_lora_half_precision_within_tolerance(ref, dtype, pool_is_float32):
    per_seq = [_lora(0, 16, 0.7) + _lora(4, 4, 0.3), [], _lora(6, 8)]
    batch = _batch([9, 2, 1], per_seq)
    pool_dtype = torch.float32 if pool_is_float32 else dtype
    y, got, expected = _run_lora(ref, batch, 576, 192, dtype=dtype, pool_dtype=pool_dtype, offset=64)
    assert got.dtype == dtype
    _close(got, expected, dtype)
    assert torch.equal(got[9:11], y[9:11])


def _table(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """IA³ vectors [16 slots, n] around 1, the last slot NaN."""
    table = 0.5 + torch.rand(NAN_PAGE + 1, n, generator=torch.Generator().manual_seed(seed))
    table[NAN_PAGE] = float("nan")
    return table.to(dtype)


def _run_ia3(ref, batch: Batch, n: int, width: int, offset: int, *, dtype=torch.float32, seed=0):
    table = _table(n, dtype, seed)
    y = torch.randn(batch.num_tokens, width, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    expected = y.clone()
    ref.ia3_scale(
        expected, [Ia3Slice(table, offset, batch.entries)], batch.query_start_loc, batch.token_ranges
    )
    e = batch.entries
    got, table_d, qsl, entry_ptr, index, scale = _on_device(
        y, table, batch.query_start_loc, e.entry_ptr, e.index, e.scale
    )
    ia3_scale(got, offset, table_d, qsl, entry_ptr, index, scale, batch.max_query_len)
    return y, got.cpu(), expected


def test_ia3_weight_one_scales_by_the_vector(ref):
    batch = _batch([3, 1, 2], [[(1, 0, 1.0)], [], [(4, 0, 1.0)]], garbage=2)
    y, got, expected = _run_ia3(ref, batch, 96, 96, 0)
    _close(got, expected, torch.float32)
    assert torch.equal(got[3], y[3])


def test_ia3_weights_blend_the_vector_toward_one(ref):
    batch = _batch([2, 1], [[(1, 0, 0.3), (2, 0, 0.7)], [(3, 0, 0.5), (1, 0, 1.0)]])
    _, got, expected = _run_ia3(ref, batch, 96, 96, 0)
    _close(got, expected, torch.float32)


def test_ia3_input_width_columns(ref):
    # Input scaling (feed-forward down projection): the whole row of x, col_offset 0.
    batch = _batch([20, 1, 1], [[(0, 0, 1.0)], [(2, 0, 0.4)], []])
    y, got, expected = _run_ia3(ref, batch, 1536, 1536, 0)
    _close(got, expected, torch.float32)
    assert torch.equal(got[21], y[21])


def test_ia3_output_columns_at_an_offset_of_a_fused_projection(ref):
    # Output scaling of v inside a fused qkv output: columns [960 + 320, 960 + 640) only.
    batch = _batch([4, 1, 2], [[(0, 0, 1.0)], [], [(1, 0, 0.5), (2, 0, 1.0)]])
    y, got, expected = _run_ia3(ref, batch, 320, 960 + 640, 1280)
    _close(got, expected, torch.float32)
    assert torch.equal(got[:, :1280], y[:, :1280])
    assert torch.equal(got[4], y[4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ia3_half_precision_within_tolerance(ref, dtype):
    batch = _batch([5, 1], [[(0, 0, 1.0), (3, 0, 0.6)], [(2, 0, 1.0)]])
    _, got, expected = _run_ia3(ref, batch, 192, 256, 64, dtype=dtype)
    assert got.dtype == dtype
    _close(got, expected, dtype)
