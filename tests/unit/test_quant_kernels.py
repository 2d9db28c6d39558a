"""The native int8 / int4 linear kernels against the torch reference (x @ dequantize(W)^T), their
batch invariance, and the lookup of embedding rows in a quantized table.

The kernels multiply in integers: they round each row of x to 16-bit integers per block of 32
inputs (csrc/qgemm.cpp). They are checked twice: tightly against x rounded the same way, and
against the torch reference within the bound that rounding allows."""

from __future__ import annotations

import pytest
import torch

from libs.engine import quant
from libs.engine.kernels.build import load

pytestmark = pytest.mark.skipif(not load(), reason="native kernels did not build on this machine")

CPU = torch.device("cpu")
# (kind, group): int8 per output channel and in GGUF's Q8_0 blocks; int4 in blocks of 32 and 64.
FORMATS = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64)]
# Decode shapes of the default model, and odd ones: output counts off the 16-column panels, one
# group per row, K not a multiple of the 256-wide K block.
SHAPES = [(960, 576), (576, 1536), (37, 64), (5, 320), (49, 128)]


def _rounded_like_the_kernels(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it, in float64: xq * step per block of 32, xq = round(x * 32767 / max|x|)."""
    blocks = x.view(len(x), -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # float32 quotients, as the kernels compute them (`32767 / amax` would be a reciprocal times 32767)
    step, inverse = amax / 32767, torch.full_like(amax, 32767) / amax
    q = torch.round(blocks * inverse).clamp(-32767, 32767)  # halves to even, like nearbyint
    return torch.where(amax > 0, q.double() * step.double(), 0.0).view(x.shape)


def _rounding_bound(x: torch.Tensor, qw: quant.QuantizedWeight) -> torch.Tensor:
    """How far rounding x may move each output: half a step per input, times |w|."""
    step = (x.view(len(x), -1, 32).abs().amax(-1) / 32767).repeat_interleave(32, dim=1)
    return step @ quant.dequantize(qw).abs().T / 2


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize(("kind", "group"), FORMATS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 50])
def test_quantized_linear_matches_the_torch_reference(native, ref, kind, group, n, k, rows):
    if group and k % group:
        pytest.skip("K is not whole groups")
    qw = quant.quantize(_weight(n, k, n + k), kind, group)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    expected = ref.linear(x, ref.prepare_quantized(qw, bias, CPU))
    got = native.linear(x, native.prepare_quantized(qw, bias, CPU))
    assert got.shape == (rows, n)
    # exactly the integer products of the rounded x, up to float32 rounding of the per-block folds
    exact = _rounded_like_the_kernels(x) @ quant.dequantize(qw).double().T + bias.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=2e-6)
    # and so within what rounding x allows of the torch reference
    slack = _rounding_bound(x, qw) + 1e-5 * expected.abs() + 2e-6
    assert ((got - expected).abs() <= slack).all()
    # and the reference is what it claims to be
    torch.testing.assert_close(expected, x @ quant.dequantize(qw).T + bias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("kind", "group"), FORMATS)
def test_quantized_rows_are_bitwise_independent_of_the_batch(native, kind, group):
    w = native.prepare_quantized(quant.quantize(_weight(300, 576, 7), kind, group), None, CPU)
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(1))
    full = native.linear(x, w)  # several blocks of 48 rows
    for rows in (1, 2, 3, 5, 6, 7, 13, 48, 49, 97):
        assert torch.equal(native.linear(x[:rows], w), full[:rows]), rows
    for row in (0, 1, 150, 199):  # alone: the decode path
        assert torch.equal(native.linear(x[row : row + 1], w), full[row : row + 1]), row
    assert torch.equal(native.linear(x[150:152], w), full[150:152])


@pytest.mark.parametrize(("kind", "group"), FORMATS)
def test_zero_and_non_finite_inputs(native, ref, kind, group):
    qw = quant.quantize(_weight(40, 128, 5), kind, group)
    bias = torch.randn(40)
    w = native.prepare_quantized(qw, bias, CPU)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    x[0] = 0.0  # every block zero: the bias exactly
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    for rows in (x, x[1:3], x[0:1]):  # the GEMM and the decode paths
        y = native.linear(rows, w)
        expected = ref.linear(rows, ref.prepare_quantized(qw, bias, CPU))
        # a non-finite input gives a non-finite row, as in float; the other rows are untouched
        assert torch.equal(y.isfinite(), expected.isfinite())
    y = native.linear(x, w)
    assert torch.equal(y[0], bias)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[3:], native.linear(x[3:], w))


@pytest.mark.parametrize(("kind", "group"), FORMATS)
def test_embedding_rows_are_the_dequantized_rows(native, ref, kind, group):
    qw = quant.quantize(_weight(77, 64, 3), kind, group)
    ids = torch.tensor([0, 76, 15, 16, 33, 15])
    expected = quant.dequantize(qw)[ids]
    assert torch.equal(native.embedding(native.prepare_quantized(qw, None, CPU), ids), expected)
    assert torch.equal(ref.embedding(ref.prepare_quantized(qw, None, CPU), ids), expected)


def test_gguf_blocks_run_through_the_kernels(native, ref):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    w = _weight(40, 96, 11).numpy()
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(2))
    for type_name in ("Q8_0", "Q4_0", "Q4_1"):
        blocks = gguf_quantize(w, GGMLQuantizationType[type_name])
        qw = quant.from_gguf(type_name, blocks, w.shape)
        for rows in (1, 4):
            got = native.linear(x[:rows], native.prepare_quantized(qw, None, CPU))
            expected = ref.linear(x[:rows], ref.prepare_quantized(qw, None, CPU))
            slack = _rounding_bound(x[:rows], qw) + 1e-5 * expected.abs() + 2e-6
            assert ((got - expected).abs() <= slack).all(), type_name


def test_groups_the_kernels_cannot_take_are_refused_at_load(native):
    with pytest.raises(ValueError, match="multiple of 32 inputs; this int4 weight has groups of 48 of 96"):
        native.prepare_quantized(quant.quantize(_weight(16, 96, 0), "int4", 48), None, CPU)
    with pytest.raises(ValueError, match="this int8 weight has groups of 40 of 40 inputs"):
        native.prepare_quantized(quant.quantize(_weight(16, 40, 0), "int8"), None, CPU)


def test_the_kernel_refuses_malformed_weights_by_what_is_wrong(native):
    qw = quant.quantize(_weight(16, 64, 0), "int4")
    w = native.prepare_quantized(qw, None, CPU)
    x = torch.randn(1, 64)
    k = torch.ops.expert_kernels
    with pytest.raises(RuntimeError, match="int4 weights need minimums"):
        k.quantized_linear(x, w.weight, w.scales, None, None, 16)
    with pytest.raises(RuntimeError, match="input has 32 features, weight expects 64"):
        k.quantized_linear(torch.randn(1, 32), w.weight, w.scales, w.mins, None, 16)
    with pytest.raises(RuntimeError, match="scales must be float16"):
        k.quantized_linear(x, w.weight, w.scales.float(), w.mins, None, 16)


def test_embedding_ids_outside_the_table_are_refused(native):
    w = native.prepare_quantized(quant.quantize(_weight(40, 64, 4), "int4", 32), None, CPU)
    with pytest.raises(RuntimeError, match="id 48 is outside the table"):
        native.embedding(w, torch.tensor([3, 48]))
