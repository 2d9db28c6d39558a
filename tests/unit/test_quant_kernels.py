"""The native int8 / int4 linear kernels against the torch reference (x @ dequantize(W)^T), their
batch invariance, and the lookup of embedding rows in a quantized table."""

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
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
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
            torch.testing.assert_close(
                native.linear(x[:rows], native.prepare_quantized(qw, None, CPU)),
                ref.linear(x[:rows], ref.prepare_quantized(qw, None, CPU)),
                rtol=1e-4,
                atol=2e-5,
            )


def test_groups_the_kernels_cannot_take_are_refused_at_load(native):
    with pytest.raises(ValueError, match="groups of 48 of 96 inputs"):
        native.prepare_quantized(quant.quantize(_weight(16, 96, 0), "int4", 48), None, CPU)


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
