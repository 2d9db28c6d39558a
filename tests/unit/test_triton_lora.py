"""The Triton LoRA (shrink + expand) and IA³ kernels against the torch reference: under the
interpreter on the CPU, compiled on a GPU when there is one (the reference always runs on the CPU).
A call covers up to three slices of a fused projection (q | k | v, gate | up), each with its own
pools, entries and columns."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from libs.engine.adapters.batch import Entries
from libs.engine.adapters.device import PAGE_ROWS
from libs.engine.kernels import Ia3Slice, LoraSlice
from libs.engine.kernels.triton import unavailable_reason
from libs.engine.kernels.triton.ia3 import ia3_scale
from libs.engine.kernels.triton.lora import BLOCK_K, SPLIT_MIN_STEPS, launch_shape, lora_apply

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    unavailable_reason(DEVICE.type) is not None, reason=str(unavailable_reason(DEVICE.type))
)

NAN_PAGE = 15  # a pool page (and IA³ slot) full of NaN that no real entry uses: reading it shows
PerSeq = list[list[tuple[int, int, float]]]


@dataclass
class Step:
    """A step's sequences: their token rows as the kernels (CSR) and the reference (ranges) read them."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    token_ranges: list[tuple[int, int]]
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return self.token_ranges[-1][1]

    def rows_without(self, *per_seqs: PerSeq) -> list[int]:
        """Token rows of the sequences that have no entry in any of `per_seqs`."""
        empty = [all(not p[b] for p in per_seqs) for b in range(len(self.token_ranges))]
        return [t for (s, e), none in zip(self.token_ranges, empty, strict=True) if none for t in range(s, e)]


def _step(lens: list[int]) -> Step:
    ends = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ends.to(torch.int32)])
    return Step(qsl, [(int(qsl[b]), int(qsl[b + 1])) for b in range(len(lens))], max(lens))


def _entries(per_seq: PerSeq, garbage: int = 0) -> Entries:
    """(index, count, weight) entries per sequence as CSR; `garbage` more entries past the real ones
    (pointing at the NaN page, weight NaN) and as many extra entry_ptr rows."""
    flat = [e for seq in per_seq for e in seq] + [(NAN_PAGE * PAGE_ROWS, PAGE_ROWS, float("nan"))] * garbage
    counts = torch.tensor([len(seq) for seq in per_seq] + [1] * garbage, dtype=torch.int32)
    return Entries(
        entry_ptr=torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)]),
        index=torch.tensor([e[0] for e in flat], dtype=torch.int32),
        count=torch.tensor([e[1] for e in flat], dtype=torch.int32),
        scale=torch.tensor([e[2] for e in flat], dtype=torch.float32),
        per_seq=per_seq,
        max_entries=max(len(seq) for seq in per_seq) + garbage,
    )


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies on the kernels' device (always copies, so the kernels never write a caller's tensor)."""
    return [t.clone().to(DEVICE) for t in tensors]


def _entries_on_device(e: Entries) -> Entries:
    ptr, index, count, scale = _on_device(e.entry_ptr, e.index, e.count, e.scale)
    return Entries(ptr, index, count, scale, e.per_seq, e.max_query_len, e.max_entries)


def _lora(page: int, rank: int, weight: float = 1.0) -> list[tuple[int, int, float]]:
    """A LoRA's entries as the step's adapter batch lists them: one per page of 8 rows from `page` on."""
    return [
        ((page + i) * PAGE_ROWS, min(PAGE_ROWS, rank - i * PAGE_ROWS), weight)
        for i in range(-(-rank // PAGE_ROWS))
    ]


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
    ref,
    step: Step,
    k: int,
    slices: list[tuple[int, Entries]],
    *,
    dtype=torch.float32,
    pool_dtype=None,
    offset=0,
    padding=0,
    seed=0,
):
    """(y before, y from the kernels, y from the reference) for one call over `slices` (width,
    entries), laid side by side in y from column `offset`; `padding` token rows past the last
    sequence's (as in a padded CUDA-graph batch)."""
    g = torch.Generator().manual_seed(seed + 100)
    total = offset + sum(width for width, _ in slices)
    x = torch.randn(step.num_tokens + padding, k, generator=g).to(dtype)
    y = torch.randn(step.num_tokens + padding, total + 5, generator=g).to(dtype)
    host, device, col = [], [], offset
    for i, (width, entries) in enumerate(slices):
        a, bt = _pools(k, width, pool_dtype or dtype, seed + i)
        host.append(LoraSlice(a, bt, col, entries))
        a_d, bt_d = _on_device(a, bt)
        device.append(LoraSlice(a_d, bt_d, col, _entries_on_device(entries)))
        col += width
    expected = y.clone()
    ref.lora_apply(expected, x, host, step.query_start_loc, step.token_ranges)
    got, x_d, qsl = _on_device(y, x, step.query_start_loc)
    max_entries = max(e.max_entries for _, e in slices)
    lora_apply(got, x_d, device, qsl, step.max_query_len, max_entries)
    return y, got.cpu(), expected


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


def test_lora_mixed_adapters_leave_rows_without_entries_bit_identical(ref):
    per_seq = [_lora(0, 8), [], _lora(2, 16), [], _lora(5, 4), _lora(0, 8)]
    step = _step([3, 4, 1, 1, 6, 1])
    y, got, expected = _run_lora(ref, step, 96, [(64, _entries(per_seq))], offset=7)
    _close(got, expected, torch.float32)
    rows = step.rows_without(per_seq)
    assert torch.equal(got[rows], y[rows])
    assert torch.equal(got[:, :7], y[:, :7]) and torch.equal(got[:, 7 + 64 :], y[:, 7 + 64 :])


def test_lora_sums_several_weighted_entries_of_one_sequence(ref):
    per_seq = [_lora(0, 8, 0.7) + _lora(3, 16, 0.3), _lora(3, 16, 0.3) + _lora(0, 8, 0.7)]
    _, got, expected = _run_lora(ref, _step([5, 1]), 64, [(96, _entries(per_seq))])
    _close(got, expected, torch.float32)


def test_lora_multi_page_ranks_and_partial_pages(ref):
    # rank 16 = two full pages, rank 4 = one page with 4 rows, rank 12 = a full page and 4 rows
    per_seq = [_lora(0, 16), _lora(4, 4), _lora(8, 12)]
    _, got, expected = _run_lora(ref, _step([2, 3, 1]), 64, [(96, _entries(per_seq))])
    _close(got, expected, torch.float32)


def test_lora_decode_only_batch(ref):
    per_seq = [_lora(i % 4 * 2, 4 + 3 * i, 0.5 + 0.1 * i) for i in range(5)] + [[]]
    y, got, expected = _run_lora(ref, _step([1] * 6), 576, [(960, _entries(per_seq))])
    _close(got, expected, torch.float32)
    assert torch.equal(got[5], y[5])


def test_lora_prefill_and_decode_mixed(ref):
    per_seq = [_lora(0, 16), _lora(2, 8), [], _lora(3, 4, 0.5) + _lora(0, 16, 0.5)]
    y, got, expected = _run_lora(ref, _step([37, 1, 20, 1]), 576, [(960, _entries(per_seq))])
    _close(got, expected, torch.float32)
    assert torch.equal(got[38:58], y[38:58])


def test_lora_never_reads_entries_past_a_sequences_last(ref):
    # The tail of index / count / scale and of entry_ptr is garbage pointing at a NaN page, and
    # token rows past the last sequence belong to no sequence.
    entries = _entries([_lora(0, 8), [], _lora(1, 12, 0.6)], garbage=3)
    assert entries.index.shape[0] > sum(len(s) for s in entries.per_seq)
    y, got, expected = _run_lora(ref, _step([4, 1, 2]), 64, [(96, entries)], padding=2)
    _close(got, expected, torch.float32)
    assert torch.equal(got[4], y[4])
    assert torch.equal(got[7:], y[7:])


def test_lora_reads_strided_x_rows(ref):
    step, entries = _step([3, 1]), _entries([_lora(0, 8), _lora(1, 4)])
    a, bt = _pools(64, 96, torch.float32, 3)
    fused = torch.randn(step.num_tokens, 64 + 32)  # x is a column slice of a wider activation
    y = torch.randn(step.num_tokens, 96)
    expected = y.clone()
    ref.lora_apply(
        expected, fused[:, 32:], [LoraSlice(a, bt, 0, entries)], step.query_start_loc, step.token_ranges
    )
    got, wide, a_d, bt_d, qsl = _on_device(y, fused, a, bt, step.query_start_loc)
    lora_apply(got, wide[:, 32:], [LoraSlice(a_d, bt_d, 0, _entries_on_device(entries))], qsl, 3, 1)
    _close(got.cpu(), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pool_is_float32", [False, True])
def test_lora_half_precision_within_tolerance(ref, dtype, pool_is_float32):
    entries = _entries([_lora(0, 16, 0.7) + _lora(4, 4, 0.3), [], _lora(6, 8)])
    pool_dtype = torch.float32 if pool_is_float32 else dtype
    y, got, expected = _run_lora(
        ref, _step([9, 2, 1]), 576, [(192, entries)], dtype=dtype, pool_dtype=pool_dtype, offset=64
    )
    assert got.dtype == dtype
    _close(got, expected, dtype)
    assert torch.equal(got[9:11], y[9:11])


def test_lora_fused_slices_each_apply_their_own_entries_in_one_call(ref):
    # q | k | v: sequence 0 has q and v but no k, sequence 1 nothing, sequence 2 only k, sequence 3
    # all three with different ranks; each slice's entry list ends in a garbage tail.
    q = [_lora(0, 16), [], [], _lora(2, 8, 0.5)]
    k = [[], [], _lora(1, 4), _lora(5, 12, 0.5)]
    v = [_lora(3, 8), [], [], _lora(0, 4, 0.5)]
    step = _step([3, 2, 1, 1])
    slices = [(96, _entries(q, garbage=2)), (32, _entries(k, garbage=1)), (32, _entries(v))]
    y, got, expected = _run_lora(ref, step, 128, slices, offset=3, padding=1)
    _close(got, expected, torch.float32)
    rows = step.rows_without(q, k, v)
    assert rows == [3, 4] and torch.equal(got[rows], y[rows])
    assert torch.equal(got[:3, 3 + 96 : 3 + 128], y[:3, 3 + 96 : 3 + 128])  # sequence 0's k
    assert torch.equal(got[5, 3 : 3 + 96], y[5, 3 : 3 + 96])  # sequence 2's q
    assert torch.equal(got[:, :3], y[:, :3]) and torch.equal(got[:, 3 + 160 :], y[:, 3 + 160 :])
    assert torch.equal(got[7:], y[7:])


def test_lora_refuses_more_slices_than_a_fused_projection_has():
    entries = _entries([_lora(0, 8)])
    a, bt = _pools(32, 16, torch.float32, 0)
    slices = [LoraSlice(a, bt, 16 * i, entries) for i in range(4)]
    with pytest.raises(ValueError, match="slices"):
        lora_apply(
            torch.zeros(1, 64), torch.zeros(1, 32), slices, torch.tensor([0, 1], dtype=torch.int32), 1, 1
        )


def test_lora_splits_a_long_k_when_the_batch_has_few_tokens():
    decode = launch_shape(14336, 1, 1, 1, 3 * 32 * 8 * 4)
    assert decode.splits > 1
    assert decode.k_per_split >= SPLIT_MIN_STEPS * BLOCK_K and decode.k_per_split % BLOCK_K == 0
    assert (decode.splits - 1) * decode.k_per_split < 14336 <= decode.splits * decode.k_per_split
    batched = launch_shape(14336, 32, 32, 1, 3 * 32 * 8 * 4)
    assert 1 < batched.splits < decode.splits
    assert launch_shape(14336, 4096, 2, 2048, 8 * 4).splits < batched.splits
    assert launch_shape(256, 1, 1, 1, 8 * 4).splits == 1  # too short to split


def test_lora_split_k_partials_add_up_to_the_reference(ref):
    # One decode token over K = 4096: the shrink splits K in several planes, the expand adds them.
    assert launch_shape(4096, 2, 2, 1, 8 * 4).splits > 1
    per_seq = [_lora(0, 16, 0.7) + _lora(4, 4, 0.3), _lora(6, 8)]
    _, got, expected = _run_lora(ref, _step([1, 1]), 4096, [(64, _entries(per_seq))])
    _close(got, expected, torch.float32)


# Every projection of Llama-3.2-1B (hidden 2048, intermediate 8192, 32 q / 8 kv heads of 64) and
# Llama-3-8B (4096, 14336, 32 / 8 heads of 128): (input width, slice widths).
MODEL_PROJECTIONS = {
    "1b-qkv": (2048, (2048, 512, 512)),
    "1b-o": (2048, (2048,)),
    "1b-gate_up": (2048, (8192, 8192)),
    "1b-down": (8192, (2048,)),
    "8b-qkv": (4096, (4096, 1024, 1024)),
    "8b-o": (4096, (4096,)),
    "8b-gate_up": (4096, (14336, 14336)),
    "8b-down": (14336, (4096,)),
}


@pytest.mark.parametrize("projection", MODEL_PROJECTIONS)
def test_lora_matches_reference_at_every_model_projection_shape(ref, projection):
    # Few tokens keep the interpreter quick: a two-token prefill, a decode token without entries and
    # one with, each slice with its own adapters. The 8B shapes run in bfloat16, the engine's GPU dtype.
    k, widths = MODEL_PROJECTIONS[projection]
    dtype = torch.bfloat16 if projection.startswith("8b") else torch.float32
    per_slice = [[_lora(2 * i, 16, 0.7), [], _lora(5 + i, 4 + 4 * i)] for i in range(len(widths))]
    slices = [(w, _entries(p)) for w, p in zip(widths, per_slice, strict=True)]
    y, got, expected = _run_lora(ref, _step([2, 1, 1]), k, slices, dtype=dtype, seed=len(projection))
    _close(got, expected, dtype)
    assert torch.equal(got[2], y[2])


def _table(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """IA³ vectors [16 slots, n] around 1, the last slot NaN."""
    table = 0.5 + torch.rand(NAN_PAGE + 1, n, generator=torch.Generator().manual_seed(seed))
    table[NAN_PAGE] = float("nan")
    return table.to(dtype)


def _run_ia3(
    ref, step: Step, slices: list[tuple[int, Entries]], width: int, offset: int, *, dtype=torch.float32
):
    """(y before, y from the kernel, y from the reference): `slices` (width, entries) side by side
    from column `offset` of a y `width` columns wide."""
    y = torch.randn(step.num_tokens, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    host, device, col = [], [], offset
    for i, (n, entries) in enumerate(slices):
        table = _table(n, dtype, i)
        host.append(Ia3Slice(table, col, entries))
        device.append(Ia3Slice(*_on_device(table), col, _entries_on_device(entries)))
        col += n
    expected = y.clone()
    ref.ia3_scale(expected, host, step.query_start_loc, step.token_ranges)
    got, qsl = _on_device(y, step.query_start_loc)
    ia3_scale(got, device, qsl, step.max_query_len)
    return y, got.cpu(), expected


def test_ia3_weight_one_scales_by_the_vector(ref):
    entries = _entries([[(1, 0, 1.0)], [], [(4, 0, 1.0)]], garbage=2)
    y, got, expected = _run_ia3(ref, _step([3, 1, 2]), [(96, entries)], 96, 0)
    _close(got, expected, torch.float32)
    assert torch.equal(got[3], y[3])


def test_ia3_weights_blend_the_vector_toward_one(ref):
    entries = _entries([[(1, 0, 0.3), (2, 0, 0.7)], [(3, 0, 0.5), (1, 0, 1.0)]])
    _, got, expected = _run_ia3(ref, _step([2, 1]), [(96, entries)], 96, 0)
    _close(got, expected, torch.float32)


def test_ia3_input_width_columns(ref):
    # Input scaling (feed-forward down projection): the whole row of x, col_offset 0.
    entries = _entries([[(0, 0, 1.0)], [(2, 0, 0.4)], []])
    y, got, expected = _run_ia3(ref, _step([20, 1, 1]), [(1536, entries)], 1536, 0)
    _close(got, expected, torch.float32)
    assert torch.equal(got[21], y[21])


def test_ia3_output_columns_at_an_offset_of_a_fused_projection(ref):
    # Output scaling of v inside a fused qkv output: columns [960 + 320, 960 + 640) only.
    entries = _entries([[(0, 0, 1.0)], [], [(1, 0, 0.5), (2, 0, 1.0)]])
    y, got, expected = _run_ia3(ref, _step([4, 1, 2]), [(320, entries)], 960 + 640, 1280)
    _close(got, expected, torch.float32)
    assert torch.equal(got[:, :1280], y[:, :1280])
    assert torch.equal(got[4], y[4])


def test_ia3_fused_slices_each_scale_their_own_columns_in_one_call(ref):
    # k and v of a fused qkv output (q unscaled), as PEFT's IA³ targets them; sequence 1 has none.
    k = _entries([[(0, 0, 1.0)], [], [(1, 0, 0.5)]], garbage=1)
    v = _entries([[(2, 0, 1.0)], [], []])
    y, got, expected = _run_ia3(ref, _step([4, 1, 2]), [(320, k), (320, v)], 960 + 640, 960)
    _close(got, expected, torch.float32)
    assert torch.equal(got[:, :960], y[:, :960])
    assert torch.equal(got[4], y[4])
    assert torch.equal(got[5:, 960 + 320 :], y[5:, 960 + 320 :])


@pytest.mark.parametrize("projection", ["8b-qkv", "8b-gate_up"])
def test_ia3_matches_reference_at_fused_model_projection_shapes(ref, projection):
    _, widths = MODEL_PROJECTIONS[projection]
    slices = [(w, _entries([[(i, 0, 1.0)], [], [(i + 1, 0, 0.5)]])) for i, w in enumerate(widths)]
    y, got, expected = _run_ia3(ref, _step([2, 1, 1]), slices, sum(widths), 0, dtype=torch.bfloat16)
    _close(got, expected, torch.bfloat16)
    assert torch.equal(got[2], y[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ia3_half_precision_within_tolerance(ref, dtype):
    entries = _entries([[(0, 0, 1.0), (3, 0, 0.6)], [(2, 0, 1.0)]])
    _, got, expected = _run_ia3(ref, _step([5, 1]), [(192, entries)], 256, 64, dtype=dtype)
    assert got.dtype == dtype
    _close(got, expected, dtype)
