"""Our decoder: one implementation for the Llama, Qwen2 and Qwen3 families.

RMSNorm, rotary embeddings, grouped-query attention over the paged KV cache, SwiGLU MLP, optional
q/k/v biases (Qwen2) and per-head QK norm (Qwen3), tied or separate LM head. The forward pass
works on a flat batch of tokens from many sequences; attention is the only place that looks at
sequence boundaries, through the step's AttentionMetadata. Projections are fused at load (one QKV
matmul, one gate/up matmul) and laid out by the operator set once. Linear weights and the LM head
may arrive quantized (int8 / int4, libs/engine/quant.py); norms always stay in float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from libs.engine import quant
from libs.engine.kernels import AttentionMetadata, HeadLayout, LinearWeight, TorchOps
from libs.engine.models.config import ModelConfig
from libs.engine.models.rope import cos_sin_table
from libs.engine.quant import QuantizedWeight

if TYPE_CHECKING:
    from libs.engine.adapters.batch import AdapterBatch

_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: LinearWeight
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight


class _WeightReader:
    """Takes the checkpoint's weights out of `weights`, each once, onto the device in the model's
    dtype; projections fused (one QKV, one gate/up) and laid out by the operator set."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        ops: TorchOps,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.weights = weights
        self.ops = ops
        self.device = device
        self.dtype = dtype

    def take(self, name: str) -> torch.Tensor:
        return self.weights.pop(name).to(device=self.device, dtype=self.dtype).contiguous()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.weights else None

    def linear(self, names: list[str], bias: bool) -> LinearWeight:
        parts = [self.weights.pop(n + ".weight") for n in names]
        b = torch.cat([self.take(n + ".bias") for n in names]) if bias else None
        if quant.same_format(parts):
            return self.ops.prepare_quantized(quant.concat_rows(parts), b, self.device)
        # Float parts, or parts of different formats (a GGUF may mix types within one layer):
        # fused in float, from their exact dequantized values.
        floats = [quant.dequantize(p) if isinstance(p, QuantizedWeight) else p for p in parts]
        return self.ops.prepare_linear(
            torch.cat([p.to(device=self.device, dtype=self.dtype) for p in floats]), b
        )

    def layer(self, config: ModelConfig, n: int) -> DecoderLayer:
        p = f"model.layers.{n}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return DecoderLayer(
            input_norm=self.take(p + "input_layernorm.weight"),
            qkv=self.linear([attn + "q_proj", attn + "k_proj", attn + "v_proj"], config.qkv_bias),
            q_norm=self.maybe(attn + "q_norm.weight"),
            k_norm=self.maybe(attn + "k_norm.weight"),
            o=self.linear([attn + "o_proj"], config.o_bias),
            post_norm=self.take(p + "post_attention_layernorm.weight"),
            gate_up=self.linear([mlp + "gate_proj", mlp + "up_proj"], config.mlp_bias),
            down=self.linear([mlp + "down_proj"], config.mlp_bias),
        )


class DecoderModel:
    """Weights plus the forward pass; holds no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        ops: TorchOps,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
    ) -> None:
        self.config = config
        self.ops = ops
        self.device = device
        self.dtype = dtype
        self.heads = HeadLayout(config.num_heads, config.num_kv_heads, config.head_dim)
        self.scale = config.head_dim**-0.5
        reader = _WeightReader(weights, ops, device, dtype)
        self.layers = [reader.layer(config, n) for n in range(config.num_layers)]
        self.norm = reader.take("model.norm.weight")
        # A tied embedding table is the LM head: its rows are looked up in the head's prepared
        # weight (packed, or quantized; a quantized table is always tied, loader.quantizable_names)
        # rather than kept twice, which for the default model in float32 is 113 MB.
        self.embed_tokens: torch.Tensor | None = None
        if config.tie_word_embeddings:
            self.lm_head = reader.linear(["model.embed_tokens"], False)
        else:
            self.embed_tokens = reader.take("model.embed_tokens.weight")
            self.lm_head = reader.linear(["lm_head"], False)
        # cos | sin per position, float32 like transformers computes them
        self.cos_sin = cos_sin_table(config.rope, config.head_dim, max_positions).to(device)
        # The layers for an operator set that runs them in one call (None: the loop in forward).
        self.layer_stack = ops.stack_layers(self.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [blocks, Hkv, block_size, D] x2
        adapters: AdapterBatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's keys and values.

        `adapters` applies each sequence's experts: soft prompts replace virtual-token embeddings,
        IA³ scales projection inputs or outputs, LoRA adds its low-rank deltas.
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        residual = self.embed(input_ids)  # [T, H]
        if adapters is not None:
            residual = adapters.embed(residual)
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        if adapters is None and self.layer_stack is not None:  # no experts to apply between kernels
            stack, cos_sin, heads, scale = self.layer_stack, self.cos_sin, self.heads, self.scale
            x = ops.run_layers(stack, x, residual, positions, cos_sin, kv_caches, meta, heads, eps, scale)
        else:
            x, residual = self._layer_loop(x, residual, positions, meta, kv_caches, adapters)
        x, _ = ops.add_rms_norm(x, residual, self.norm, eps)
        return x

    def _layer_loop(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        adapters: AdapterBatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers one kernel at a time, applying experts between them: the last layer's
        output and the residual stream."""
        ops, eps, c = self.ops, self.config.rms_norm_eps, self.config
        for n, layer in enumerate(self.layers):
            if n > 0:
                x, residual = ops.add_rms_norm(x, residual, layer.input_norm, eps)
            k_cache, v_cache = kv_caches[n]
            qkv = ops.linear(x, layer.qkv)  # [T, (Hq + 2 Hkv) D]
            if adapters is not None:
                adapters.apply_output(ops, n, _QKV, (0, c.q_size, c.q_size + c.kv_size), qkv, x)
            q = ops.rope_and_cache(
                qkv,
                positions,
                self.cos_sin,
                k_cache,
                v_cache,
                meta.slot_mapping,
                self.heads,
                layer.q_norm,
                layer.k_norm,
                eps,
            )  # [T, Hq, D]
            attended = ops.attention(q, k_cache, v_cache, meta, self.scale)
            if adapters is not None:
                attended = adapters.scale_input(ops, n, "o_proj", attended)
            x = ops.linear(attended, layer.o)
            if adapters is not None:
                adapters.apply_output(ops, n, ("o_proj",), (0,), x, attended)
            x, residual = ops.add_rms_norm(x, residual, layer.post_norm, eps)
            gate_up = ops.linear(x, layer.gate_up)
            if adapters is not None:
                adapters.apply_output(ops, n, _GATE_UP, (0, c.intermediate_size), gate_up, x)
            hidden = ops.silu_and_mul(gate_up)
            if adapters is not None:
                hidden = adapters.scale_input(ops, n, "down_proj", hidden)
            x = ops.linear(hidden, layer.down)
            if adapters is not None:
                adapters.apply_output(ops, n, ("down_proj",), (0,), x, hidden)
        return x, residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens[input_ids]
        return self.ops.embedding(self.lm_head, input_ids).to(self.dtype)

    @property
    def weight_formats(self) -> dict[str, int]:
        """How many linear weights (the LM head included) are in each format: float, int8, int4."""
        linears = [self.lm_head] + [
            w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        counts: dict[str, int] = {}
        for w in linears:
            counts[w.kind] = counts.get(w.kind, 0) + 1
        return counts

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [S, vocab] for the selected hidden states [S, hidden]."""
        return self.ops.linear(hidden, self.lm_head).float()
