"""The GPU operator set: the Triton kernels of `kernels/triton/` behind the operator interface.

Linear layers stay cuBLAS matmuls (`F.linear`; projections are fused at load, so one QKV and one
gate/up matmul). Everything between them is a Triton kernel that reads its inputs where they lie:
RMSNorm fused with the residual add, rotary embedding fused with the QK norm and the KV-cache
write, SiLU·mul, paged attention over the block table, and the batched LoRA / IA³ kernels indexed
by the step's CSR entries, one set of launches for all the slices of a fused projection. None of
them reads a device value on the host, so a decode step can be captured in a CUDA graph
(`graph_safe`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.engine.kernels.reference import AttentionMetadata, HeadLayout, Ia3Slice, LoraSlice, TorchOps
from libs.engine.kernels.triton import attention, fused, ia3, lora, sampling


class TritonOps(TorchOps):
    """Triton kernels for the operators between the matmuls; any float dtype, CUDA (or the CPU
    under Triton's interpreter, for tests)."""

    name = "triton"
    graph_safe = True
    top_p_cutoff = staticmethod(sampling.top_p_cutoff)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place on both: x is a fresh projection output, residual is the model's own stream.
        return fused.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_and_mul(x)

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
        return fused.rope_and_cache(
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
        return attention.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
        )

    def lora_apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        slices: Sequence[LoraSlice],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
    ) -> None:
        # Every slice's entries come from one step's plan: one bound on tokens and entries.
        bounds = slices[0].entries
        lora.lora_apply(y, x, slices, query_start_loc, bounds.max_query_len, bounds.max_entries)

    def ia3_scale(
        self,
        y: torch.Tensor,
        slices: Sequence[Ia3Slice],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
    ) -> None:
        ia3.ia3_scale(y, slices, query_start_loc, slices[0].entries.max_query_len)
