"""The quantized weight formats (libs/engine/quant.py) against gguf's own reference: GGUF's Q8_0,
Q4_0 and Q4_1 tensors read as they are dequantize to exactly what gguf dequantizes them to, and
quantizing at load stays within half a step of every weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from libs.config import ConfigError
from libs.engine.config import EngineConfig
from libs.engine.quant import (
    UnsupportedTensorType,
    dequantize,
    from_gguf,
    linear,
    quantize,
)

SHAPES = [(8, 64), (5, 96), (3, 32)]  # odd output counts, several blocks per row


def _weights(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_tensors_read_as_they_are_dequantize_like_gguf(type_name, shape):
    kind = GGMLQuantizationType[type_name]
    blocks = gguf_quantize(_weights(shape), kind)
    w = from_gguf(type_name, blocks, shape)
    expected = gguf_dequantize(blocks, kind).reshape(shape)
    assert w.kind == ("int8" if type_name == "Q8_0" else "int4") and w.group_size == 32
    assert torch.equal(dequantize(w), torch.from_numpy(expected))
    # Nothing went through float32: the packed bytes are the file's (Q4_0 gains its implied minimums).
    assert w.nbytes == blocks.nbytes + (2 * w.mins.numel() if type_name == "Q4_0" else 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_per_channel_is_within_half_a_step(shape):
    weight = torch.from_numpy(_weights(shape, seed=1))
    w = quantize(weight, "int8")
    assert w.group_size == shape[1] and w.scales.shape == (shape[0], 1)
    step = w.scales.to(torch.float32)
    assert ((dequantize(w) - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_groups_of_32_are_within_half_a_step(shape):
    weight = torch.from_numpy(_weights(shape, seed=2))
    w = quantize(weight, "int4")
    assert w.group_size == 32 and w.qweight.shape == (shape[0], shape[1] // 2)
    step = w.scales.to(torch.float32).repeat_interleave(32, dim=1)
    error = (dequantize(w) - weight).abs()
    # half a step, plus the minimum's float16 rounding
    assert (error <= step / 2 + weight.abs().max() * 2**-10).all()


def test_quantizing_a_dequantized_q4_1_tensor_again_gives_its_values_back():
    shape = (6, 64)
    blocks = gguf_quantize(_weights(shape, seed=3), GGMLQuantizationType.Q4_1)
    loaded = from_gguf("Q4_1", blocks, shape)
    again = quantize(dequantize(loaded), "int4")
    assert torch.allclose(dequantize(again), dequantize(loaded), atol=2e-4)


def test_the_reference_linear_is_x_times_the_dequantized_weight():
    weight = torch.from_numpy(_weights((7, 64), seed=4))
    x = torch.randn(3, 64)
    for kind in ("int8", "int4"):
        w = quantize(weight, kind)
        assert torch.equal(linear(x, w), x @ dequantize(w).T)


def test_a_constant_row_quantizes_without_dividing_by_zero():
    weight = torch.zeros(2, 32)
    weight[1] = 0.25
    for kind in ("int8", "int4"):
        # exact but for the float16 rounding of the scale
        assert torch.allclose(dequantize(quantize(weight, kind)), weight, atol=1e-3, rtol=0)


def test_unsupported_types_and_names_are_refused_by_name():
    with pytest.raises(UnsupportedTensorType, match="Q5_K"):
        from_gguf("Q5_K", np.zeros((1, 176), dtype=np.uint8), (1, 256))
    with pytest.raises(ConfigError, match=r"^quantization: expected one of int8, int4 or none, got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ConfigError, match=r"^EXPERT_QUANTIZATION: .*got 'q4_k'"):
        EngineConfig.from_env({"EXPERT_QUANTIZATION": "q4_k"})
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig.from_env({"EXPERT_QUANTIZATION": "int4"}).quantization == "int4"
