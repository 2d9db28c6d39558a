"""The native CPU operator set: the C++ kernels in csrc/, batch-invariant by construction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from libs.engine.host_memory import WeightArena
from libs.engine.kernels.reference import (
    AttentionMetadata,
    HeadLayout,
    Ia3Slice,
    LinearWeight,
    LoraSlice,
    TorchOps,
)
from libs.engine.quant import QuantizedWeight, unpack_nibbles

PANEL = 16  # output columns per weight panel (csrc/gemm_tiles.h)
BLOCK = 32  # inputs per block of x the kernels round to 16-bit integers (kBlock in csrc/qgemm.cpp)
# Bit offset of input 8 kk + b in the int4 word of inputs [8 kk, 8 kk + 8): pairs (2 i, 2 i + 1)
# sit at bits 4 i and 16 + 4 i, so one shift and one mask yield a pair as two 16-bit lanes.
NIBBLE_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)


def quantized_panels(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The codes, scales and mins of `w` in the layout csrc/qgemm.cpp reads: panels of 16 output
    columns (zero-padded). int8 codes: [P][K / 2][16][2], a column's codes for inputs 2 kp and
    2 kp + 1 side by side, as [P][K / 2][32]. int4 codes: a little-endian 32-bit word per column
    per 8 inputs (bit offsets NIBBLE_SHIFTS), as bytes [P][K / 8][64]. Scales and mins:
    [P][K / group][16] float16."""
    n, k = w.out_features, w.in_features
    panels = -(-n // PANEL)

    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [n, width] -> [P, width, 16]
        padded = torch.zeros((panels * PANEL, t.shape[1]), dtype=t.dtype)
        padded[:n] = t
        return padded.view(panels, PANEL, -1).transpose(1, 2).contiguous()

    if w.kind == "int8":
        codes = (
            by_panel(w.qweight)
            .view(panels, k // 2, 2, PANEL)
            .transpose(2, 3)
            .reshape(panels, k // 2, 2 * PANEL)
        )
    else:
        values = by_panel(unpack_nibbles(w.qweight, w.group_size)).view(panels, k // 8, 8, PANEL)
        words = torch.zeros((panels, k // 8, PANEL), dtype=torch.int64)
        for b in range(8):
            words |= values[:, :, b].to(torch.int64) << int(NIBBLE_SHIFTS[b])
        codes = (
            words.view(torch.uint8).view(panels, k // 8, PANEL, 8)[..., :4].reshape(panels, k // 8, 4 * PANEL)
        )
    mins = None if w.mins is None else by_panel(w.mins)
    return codes, by_panel(w.scales), mins


class NativeOps(TorchOps):
    """fp32 CPU operators backed by torch.ops.expert_kernels (see csrc/)."""

    name = "native"

    def __init__(self) -> None:
        self._k = torch.ops.expert_kernels
        # Packed weights, in the order the model prepares them: the order a forward pass reads them.
        self._arena = WeightArena()

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeight:
        packed = self._arena.copy(self._k.pack_linear_weight(weight.float().contiguous()))
        return LinearWeight(packed, None if bias is None else bias.float(), weight.shape[1], weight.shape[0])

    def prepare_quantized(
        self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device
    ) -> LinearWeight:
        group, k = weight.group_size, weight.in_features
        if group % BLOCK:
            raise ValueError(
                f"quantization: the native kernels take groups of a multiple of {BLOCK} inputs; this "
                f"{weight.kind} weight has groups of {group} of {k} inputs"
            )
        codes, scales, mins = (None if t is None else self._arena.copy(t) for t in quantized_panels(weight))
        return LinearWeight(
            codes,
            None if bias is None else bias.float(),
            weight.in_features,
            weight.out_features,
            weight.kind,
            scales,
            mins,
            weight.group_size,
        )

    def linear(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if w.kind != "float":
            return self._k.quantized_linear(x, w.weight, w.scales, w.mins, w.bias, w.out_features)
        return self._k.linear(x, w.weight, w.bias, w.out_features)

    def embedding(self, w: LinearWeight, ids: torch.Tensor) -> torch.Tensor:
        if w.kind != "float":
            return self._k.quantized_embedding(w.weight, w.scales, w.mins, ids.long())
        # Row n of the weight is lane n % 16 of panel n // 16 at every k: [P, K, 16].
        return w.weight[ids // PANEL, :, ids % PANEL]

    def stack_layers(self, layers: Sequence[Any]) -> tuple[list[torch.Tensor | None], list[int]]:
        """Per layer, the slots csrc/layers.cpp reads: the four norms (q/k None when absent), then
        each projection's weight, scales, mins and bias (None when absent), and its output size."""
        weights: list[torch.Tensor | None] = []
        sizes: list[int] = []
        for layer in layers:
            weights += [layer.input_norm, layer.q_norm, layer.k_norm, layer.post_norm]
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
                weights += [w.weight, w.scales, w.mins, w.bias]
                sizes.append(w.out_features)
        return weights, sizes

    def run_layers(
        self,
        stack: tuple[list[torch.Tensor | None], list[int]],
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        heads: HeadLayout,
        eps: float,
        scale: float,
    ) -> torch.Tensor:
        """The model's layer loop in one call (csrc/layers.cpp): the same kernels in the same order,
        for steps without experts. x is the first layer's normed input; residual is updated in place."""
        weights, sizes = stack
        return self._k.decoder_layers(
            x,
            residual,
            positions,
            cos_sin,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            weights,
            sizes,
            heads.num_heads,
            heads.num_kv_heads,
            heads.head_dim,
            eps,
            scale,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel updates both in place: x is a fresh projection output, residual is ours.
        self._k.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.silu_and_mul(x)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0:
            return super().argmax(logits)
        return self._k.argmax_rows(logits)

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        heads: HeadLayout,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        return self._k.rotary_embedding_and_cache(
            qkv,
            positions,
            cos_sin,
            k_cache,
            v_cache,
            slot_mapping,
            heads.num_heads,
            heads.num_kv_heads,
            heads.head_dim,
            q_norm,
            k_norm,
            eps,
        )

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._k.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
        )

    def lora_apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        slices: Sequence[LoraSlice],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
    ) -> None:
        # One kernel call per slice: slices own disjoint columns, so the bits are those of a call
        # per projection.
        for s in slices:
            e = s.entries
            self._k.lora_apply(
                y, x, s.a, s.bt, s.col_offset, query_start_loc, e.entry_ptr, e.index, e.count, e.scale
            )

    def ia3_scale(
        self,
        y: torch.Tensor,
        slices: Sequence[Ia3Slice],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
    ) -> None:
        for s in slices:
            e = s.entries
            self._k.ia3_scale(y, s.col_offset, s.table, query_start_loc, e.entry_ptr, e.index, e.scale)

    @staticmethod
    def supports(head_dim: int, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when the kernels can run this model here, else the reason they cannot."""
        if device.type != "cpu":
            return f"native kernels are CPU-only (device is {device.type})"
        if dtype != torch.float32:
            return f"native kernels are float32-only (dtype is {dtype})"
        if not torch.ops.expert_kernels.supports_head_dim(head_dim):
            return f"native kernels do not support head_dim {head_dim}"
        return None
