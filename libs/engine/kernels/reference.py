"""The pure-torch implementation of the engine's operators.

It runs on any device and dtype (CUDA included) and is the reference the native CPU kernels are
tested against. Attention gathers each sequence's blocks into a padded batch and calls
`scaled_dot_product_attention`; on a GPU a paged-attention kernel taking the block table
directly (FlashAttention / FlashInfer style) would replace `attention` behind the same signature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from libs.engine import quant
from libs.engine.quant import QuantizedWeight


@dataclass(frozen=True)
class LinearWeight:
    """A linear layer's weight in the layout its operator set wants, plus the optional bias.

    `kind` "float": `weight` holds the values. "int8" / "int4" (libs/engine/quant.py): `weight`
    holds the codes, `scales` (and `mins`, int4) their float16 groups of `group_size` inputs.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    kind: str = "float"
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 0

    @property
    def quantized(self) -> QuantizedWeight:
        """The quantized weight in quant.py's row layout (TorchOps keeps it that way)."""
        return QuantizedWeight(
            self.kind,
            self.weight,
            self.scales,
            self.mins,
            self.group_size,
            self.out_features,
            self.in_features,
        )

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weight reads (padding included)."""
        tensors = (self.weight, self.scales, self.mins, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys are, built once per step by the runner.

    Sequence b owns tokens [query_start_loc[b], query_start_loc[b+1]) of the flat batch and has
    seq_lens[b] tokens in the cache once this step's keys are written; its queries are its last
    tokens. block_tables rows are padded with the null block 0.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend_state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoraSlice:
    """One projection of a (possibly fused) output for `lora_apply`: its layer's pool rows, the
    columns of the output it owns, and the step's entries for it. A fused projection (q/k/v,
    gate/up) passes one slice per part, so an operator set can serve them in one launch."""

    a: torch.Tensor  # [rows, in] A rows
    bt: torch.Tensor  # [rows, out] B transposed, times the LoRA scaling
    col_offset: int  # the slice's first column in the fused output
    entries: Any  # libs.engine.adapters.batch.Entries


@dataclass(frozen=True)
class Ia3Slice:
    """One projection's columns for `ia3_scale`: its layer's IA³ table, the columns it owns, and the
    step's entries for it (one slice per part of a fused output)."""

    table: torch.Tensor  # [slots, n]
    col_offset: int
    entries: Any  # libs.engine.adapters.batch.Entries


class TorchOps:
    """Operators written with torch functions only."""

    name = "torch"
    # Whether every operator can be captured in a CUDA graph (no host syncs, grids from host ints).
    # These are not: attention builds its padded batch with `nonzero`.
    graph_safe = False
    # A one-launch search for top-p's cut-off (top_p_cutoff(probs, wanted) -> [S]), used by the
    # sampler where it must not wait for the device; None: it sorts the vocabulary instead.
    top_p_cutoff: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def stack_layers(self, layers: Sequence[Any]) -> Any | None:
        """The model's decoder layers (each with input_norm, qkv, q_norm, k_norm, o, post_norm,
        gate_up and down) prepared for an operator set that runs them all in one call, or None: this
        one runs them from the model's loop, one operator at a time."""
        return None

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeight:
        return LinearWeight(weight.contiguous(), bias, weight.shape[1], weight.shape[0])

    def prepare_quantized(
        self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device
    ) -> LinearWeight:
        w = quant.to_device(weight, device)
        return LinearWeight(
            w.qweight, bias, w.in_features, w.out_features, w.kind, w.scales, w.mins, w.group_size
        )

    def linear(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if w.kind != "float":
            return quant.linear(x, w.quantized, w.bias)
        return F.linear(x, w.weight, w.bias)

    def embedding(self, w: LinearWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a prepared weight: the lookup into a tied LM head (float32 when quantized)."""
        if w.kind == "float":
            return w.weight[ids]
        return quant.rows(w.quantized, ids)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy decoding's token per row of [S, V] logits: the first index of the row's largest
        value, or of its first NaN (torch.argmax's answer)."""
        return logits.argmax(dim=-1)

    def rope_and_cache(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [max_pos, D]
        k_cache: torch.Tensor,  # [blocks, Hkv, block_size, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
        heads: HeadLayout,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
        if k_norm is not None:
            k = self.rms_norm(k, k_norm, eps)
        table = cos_sin[positions].to(qkv.dtype)  # [T, D]
        cos, sin = table[:, None, : d // 2], table[:, None, d // 2 :]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        block_size = k_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        k, v = k[valid], v[valid]
        if k_cache.dtype == torch.int8:
            k, v = quantize_kv_rows(k), quantize_kv_rows(v)
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v
        return q

    def attention(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state = meta.backend_state.get("torch") or _padded_batch(meta, q.device)
        meta.backend_state["torch"] = state
        _, hq, d = q.shape
        num_seqs, q_max = state["query_index"].shape
        hkv = k_cache.shape[1]
        padded_q = torch.cat([q, q.new_zeros(1, hq, d)])[state["query_index"]].transpose(1, 2)
        tables = state["block_tables"]
        keys, values = k_cache[tables], v_cache[tables]  # [B, blocks, Hkv, block_size, row]
        if k_cache.dtype == torch.int8:
            keys, values = dequantize_kv_rows(keys, q.dtype), dequantize_kv_rows(values, q.dtype)
        keys = keys.permute(0, 2, 1, 3, 4).reshape(num_seqs, hkv, -1, d)
        values = values.permute(0, 2, 1, 3, 4).reshape(num_seqs, hkv, -1, d)
        out = F.scaled_dot_product_attention(
            padded_q, keys, values, attn_mask=state["mask"], scale=scale, enable_gqa=hq != hkv
        )
        flat = out.transpose(1, 2).reshape(num_seqs * q_max, hq * d)
        return flat[state["valid_rows"]]

    def lora_apply(
        self,
        y: torch.Tensor,  # [T, out_total], updated in place
        x: torch.Tensor,  # [T, in]
        slices: Sequence[LoraSlice],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
    ) -> None:
        """y[:, s.col_offset:s.col_offset+out] += weight * (x A^T) B^T for each slice s and each
        sequence's LoRA entries of that slice.

        The delta is computed in float32 whatever the model's and the pools' dtypes, and added to y
        in float32 before y's rounding, as peft does with its float32 adapter weights."""
        for s in slices:
            out = s.bt.shape[1]
            for (start, end), seq_entries in zip(token_ranges, s.entries.per_seq, strict=True):
                for row, count, weight in seq_entries:
                    shrunk = x[start:end].float() @ s.a[row : row + count].float().t()  # [t, count]
                    delta = (shrunk * weight) @ s.bt[row : row + count].float()
                    y[start:end, s.col_offset : s.col_offset + out] += delta

    def ia3_scale(
        self,
        y: torch.Tensor,  # [T, width_total], updated in place
        slices: Sequence[Ia3Slice],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
    ) -> None:
        """y[:, s.col_offset:s.col_offset+n] *= l (weight 1) or 1 + weight (l - 1), for each slice s
        and each sequence's IA³ entries of that slice (the factors in float32, y rounded once per
        entry)."""
        for s in slices:
            n = s.table.shape[1]
            for (start, end), seq_entries in zip(token_ranges, s.entries.per_seq, strict=True):
                for slot, _, weight in seq_entries:
                    vector = s.table[slot].float()
                    factor = vector if weight == 1.0 else 1.0 + weight * (vector - 1.0)
                    y[start:end, s.col_offset : s.col_offset + n] *= factor


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] as the int8 cache stores them (csrc/kv_int8.h): [..., D + 4] int8, the codes
    round(x / scale) (half to even) and then the float32 scale max|x| / 127, computed in float32
    with the same roundings as the kernel, so both write the same bytes."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / divisor).clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 cache rows back to [..., D] values in `dtype` (codes x scale)."""
    codes, scale_bytes = rows[..., :-4], rows[..., -4:]
    scale = scale_bytes.contiguous().view(torch.float32)  # [..., 1]
    return (codes.float() * scale).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _padded_batch(meta: AttentionMetadata, device: torch.device) -> dict[str, torch.Tensor]:
    """Index tensors that lay the flat queries out as [B, max_query_len] and mask the keys."""
    qsl = meta.query_start_loc.to(device=device, dtype=torch.int64)
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    total = int(qsl[-1])
    steps = torch.arange(meta.max_query_len, device=device)
    is_query = steps[None, :] < q_lens[:, None]  # [B, Qmax]
    query_index = torch.where(
        is_query, qsl[:-1, None] + steps[None, :], torch.full_like(steps, total)[None, :]
    )
    num_blocks = -(-meta.max_seq_len // meta.block_size)
    keys = torch.arange(num_blocks * meta.block_size, device=device)
    positions = seq_lens[:, None] - q_lens[:, None] + steps[None, :]  # [B, Qmax]
    mask = keys[None, None, :] <= positions[:, :, None]
    mask[:, :, 0] = True  # padding rows attend to one key instead of none (no NaN)
    return {
        "query_index": query_index,
        "block_tables": meta.block_tables[:, :num_blocks].to(device=device, dtype=torch.int64),
        "mask": mask[:, None],
        "valid_rows": is_query.reshape(-1).nonzero().squeeze(1),
    }
