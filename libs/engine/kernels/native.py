"""The native CPU operator set: the C++ kernels in csrc/, batch-invariant by construction."""

from __future__ import annotations

from typing import Any

import torch

from libs.engine.kernels.reference import AttentionMetadata, HeadLayout, LinearWeight, TorchOps


class NativeOps(TorchOps):
    """fp32 CPU operators backed by torch.ops.expert_kernels (see csrc/)."""

    name = "native"

    def __init__(self) -> None:
        self._k = torch.ops.expert_kernels

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeight:
        packed = self._k.pack_linear_weight(weight.float().contiguous())
        return LinearWeight(packed, None if bias is None else bias.float(), weight.shape[1], weight.shape[0])

    def linear(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        return self._k.linear(x, w.weight, w.bias, w.out_features)

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
        a: torch.Tensor,
        bt: torch.Tensor,
        col_offset: int,
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
        entries: Any,
    ) -> None:
        self._k.lora_apply(
            y,
            x,
            a,
            bt,
            col_offset,
            query_start_loc,
            entries.entry_ptr,
            entries.index,
            entries.count,
            entries.scale,
        )

    def ia3_scale(
        self,
        y: torch.Tensor,
        col_offset: int,
        table: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
        entries: Any,
    ) -> None:
        self._k.ia3_scale(
            y, col_offset, table, query_start_loc, entries.entry_ptr, entries.index, entries.scale
        )

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
