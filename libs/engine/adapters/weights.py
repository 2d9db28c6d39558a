"""An expert's weights in the engine's terms, converted from a verified package's PEFT tensors.

LoRA becomes, per targeted projection, A stacked over layers [layers, rank, in] and B transposed and
pre-scaled by the LoRA scaling [layers, rank, out]; IA³ becomes one vector per layer and projection,
scaling the projection's output or (for PEFT "feedforward" modules) its input; a soft prompt is its
embedding rows. Every tensor PEFT should have saved is required, with the shape this model implies;
anything else is refused by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from libs.engine.models.config import ModelConfig
from libs.experts.package import VerifiedPackage
from libs.experts.projections import INPUT_SCALABLE, PROJECTIONS

_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


class AdapterWeightsError(ValueError):
    """Adapter tensors that do not fit the served model; the message names the tensor."""


def projection_shape(model: ModelConfig, projection: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of this model."""
    h, i = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (h, model.q_size),
        "k_proj": (h, model.kv_size),
        "v_proj": (h, model.kv_size),
        "o_proj": (model.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[projection]


@dataclass(frozen=True)
class LoraWeights:
    rank: int
    a: dict[str, torch.Tensor]  # projection -> [layers, rank, in]
    bt: dict[str, torch.Tensor]  # projection -> [layers, rank, out], times the LoRA scaling


@dataclass(frozen=True)
class IA3Weights:
    vectors: dict[str, torch.Tensor]  # projection -> [layers, width]
    scales_input: dict[str, bool]  # projection -> scales its input (PEFT feedforward) rather than output


@dataclass(frozen=True)
class SoftPromptWeights:
    embeddings: torch.Tensor  # [virtual tokens, hidden]


@dataclass(frozen=True)
class AdapterWeights:
    adapter_type: str
    lora: LoraWeights | None = None
    ia3: IA3Weights | None = None
    soft_prompt: SoftPromptWeights | None = None

    @property
    def nbytes(self) -> int:
        tensors: list[torch.Tensor] = []
        if self.lora:
            tensors += [*self.lora.a.values(), *self.lora.bt.values()]
        if self.ia3:
            tensors += list(self.ia3.vectors.values())
        if self.soft_prompt:
            tensors.append(self.soft_prompt.embeddings)
        return sum(t.numel() * t.element_size() for t in tensors)


_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_A\.weight|lora_B\.weight|ia3_l)"
)


def adapter_weights(package: VerifiedPackage, model: ModelConfig) -> AdapterWeights:
    """Convert a verified package's PEFT tensors for `model` (float32, on the CPU)."""
    manifest = package.manifest
    tensors = {name: t.to(torch.float32) for name, t in package.tensors().items()}
    if manifest.adapter_type == "soft_prompt":
        return AdapterWeights(
            "soft_prompt", soft_prompt=_soft_prompt(tensors, manifest.num_virtual_tokens, model)
        )
    targets = tuple(manifest.target_modules)
    for projection in targets:
        if projection not in PROJECTIONS:
            raise AdapterWeightsError(
                f"manifest.target_modules: {projection!r} is not a projection of this model "
                f"(one of {', '.join(PROJECTIONS)})"
            )
    by_key = _index(tensors)
    if manifest.adapter_type == "lora":
        scaling = manifest.alpha / (math.sqrt(manifest.rank) if manifest.use_rslora else manifest.rank)
        return AdapterWeights("lora", lora=_lora(by_key, targets, manifest.rank, scaling, model))
    return AdapterWeights("ia3", ia3=_ia3(by_key, targets, set(manifest.feedforward_modules), model))


def _index(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str, str], torch.Tensor]:
    """(layer, projection, kind) -> tensor; any key that is not a projection adapter tensor is refused."""
    out = {}
    for name, tensor in tensors.items():
        match = _KEY.fullmatch(name)
        if match is None or _PARENT.get(match.group(3)) != match.group(2):
            raise AdapterWeightsError(f"adapter_model.safetensors: unexpected tensor {name!r}")
        out[(int(match.group(1)), match.group(3), match.group(4))] = tensor
    return out


def _take(by_key, layer: int, projection: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    name = f"base_model.model.model.layers.{layer}.{_PARENT[projection]}.{projection}.{kind}"
    tensor = by_key.pop((layer, projection, kind), None)
    if tensor is None:
        raise AdapterWeightsError(f"adapter_model.safetensors: tensor {name!r} is missing")
    if tuple(tensor.shape) != shape:
        raise AdapterWeightsError(
            f"adapter_model.safetensors: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"this model needs {shape}"
        )
    return tensor


def _leftover(by_key) -> None:
    if by_key:
        layer, projection, kind = sorted(by_key)[0]
        raise AdapterWeightsError(
            f"adapter_model.safetensors: unexpected tensor for layer {layer} "
            f"{projection}.{kind} (not a target, or no such layer)"
        )


def _lora(by_key, targets, rank: int, scaling: float, model: ModelConfig) -> LoraWeights:
    a, bt = {}, {}
    for projection in targets:
        fan_in, fan_out = projection_shape(model, projection)
        layers_a, layers_bt = [], []
        for layer in range(model.num_layers):
            layers_a.append(_take(by_key, layer, projection, "lora_A.weight", (rank, fan_in)))
            layers_bt.append(_take(by_key, layer, projection, "lora_B.weight", (fan_out, rank)).t() * scaling)
        a[projection] = torch.stack(layers_a).contiguous()
        bt[projection] = torch.stack(layers_bt).contiguous()
    _leftover(by_key)
    return LoraWeights(rank, a, bt)


def _ia3(by_key, targets, feedforward: set[str], model: ModelConfig) -> IA3Weights:
    vectors, scales_input = {}, {}
    for projection in targets:
        fan_in, fan_out = projection_shape(model, projection)
        on_input = projection in feedforward
        if on_input and projection not in INPUT_SCALABLE:
            raise AdapterWeightsError(
                f"manifest.feedforward_modules: input scaling of {projection!r} is not "
                f"supported (only {', '.join(INPUT_SCALABLE)})"
            )
        shape = (1, fan_in) if on_input else (fan_out, 1)
        vectors[projection] = torch.stack(
            [
                _take(by_key, layer, projection, "ia3_l", shape).reshape(-1)
                for layer in range(model.num_layers)
            ]
        ).contiguous()
        scales_input[projection] = on_input
    _leftover(by_key)
    return IA3Weights(vectors, scales_input)


def _soft_prompt(
    tensors: dict[str, torch.Tensor], num_virtual: int | None, model: ModelConfig
) -> SoftPromptWeights:
    extra = sorted(set(tensors) - {"prompt_embeddings"})
    if extra:
        raise AdapterWeightsError(f"adapter_model.safetensors: unexpected tensor {extra[0]!r}")
    embeddings = tensors.get("prompt_embeddings")
    if embeddings is None:
        raise AdapterWeightsError("adapter_model.safetensors: tensor 'prompt_embeddings' is missing")
    shape = (num_virtual, model.hidden_size)
    if tuple(embeddings.shape) != shape:
        raise AdapterWeightsError(
            f"adapter_model.safetensors: tensor 'prompt_embeddings' has shape "
            f"{tuple(embeddings.shape)}, this model needs {shape}"
        )
    return SoftPromptWeights(embeddings.contiguous())
