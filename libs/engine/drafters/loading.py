"""The model drafter an engine's `speculative` setting names, checked and loaded at start-up.

- "base": the engine's own model, run without experts, drafts for requests with experts (a request
  without experts has no cheaper base model: it drafts with the n-gram drafter instead);
- "int4": the engine's checkpoint quantized to int4 at load drafts for every request of a float32 or
  int8 engine (refused for an int4 engine, whose drafter would be itself);
- "draft:<path>": a separate checkpoint sharing the tokenizer drafts for every request (refused
  when its vocabulary or vocabulary size differs: its token ids would mean other tokens).
"""

from __future__ import annotations

import logging
from pathlib import Path

from libs.engine import host_memory
from libs.engine.config import DRAFT_PREFIX, ConfigError, EngineConfig
from libs.engine.drafters.model_drafter import ModelDrafter
from libs.engine.kernels import TorchOps, select_ops
from libs.engine.models.config import CheckpointError, ModelConfig
from libs.engine.models.decoder import DecoderModel
from libs.engine.models.loader import load_weights
from libs.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MODEL_DRAFTERS = ("base", "int4")  # and DRAFT_PREFIX + a path


def is_model_drafter(setting: str) -> bool:
    return setting in MODEL_DRAFTERS or setting.startswith(DRAFT_PREFIX)


def drafter_config(config: EngineConfig, target: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The config of the model `config.scheduler.speculative` names (one of the model drafters),
    checked before anything is loaded: the engine sizes the drafter's KV cache from it."""
    setting = config.scheduler.speculative
    if setting == "base":
        return target
    if setting == "int4":
        if config.quantization == "int4":
            raise ConfigError(
                "speculative: int4 drafts for a float32 or int8 engine; this engine's weights are "
                "int4 already (EXPERT_QUANTIZATION), so its drafter would be itself: use ngram"
            )
        return target
    return _draft_config(Path(setting[len(DRAFT_PREFIX) :]), target, tokenizer)


def load_drafter(
    config: EngineConfig, target: DecoderModel, draft_config: ModelConfig, num_blocks: int, max_model_len: int
) -> ModelDrafter:
    """The drafter for `config.scheduler.speculative` (its config from drafter_config), with a KV
    cache of `num_blocks` blocks (as many as the target's, so it never runs short first)."""
    setting = config.scheduler.speculative
    block_size = config.cache.block_size
    if setting == "base":
        return ModelDrafter(target, num_blocks, block_size, max_model_len, experts_only=True)
    if setting == "int4":
        model = _decoder(config.model, draft_config, target, "int4", max_model_len)
        return ModelDrafter(model, num_blocks, block_size, max_model_len, experts_only=False)
    path = Path(setting[len(DRAFT_PREFIX) :])
    draft_len = min(max_model_len, draft_config.max_position_embeddings)
    model = _decoder(path, draft_config, target, None, draft_len)
    return ModelDrafter(model, num_blocks, block_size, draft_len, experts_only=False)


def _decoder(
    directory: str | Path, config: ModelConfig, target: DecoderModel, quantization: str | None, max_len: int
) -> DecoderModel:
    ops = target.ops
    if config.head_dim != target.config.head_dim:
        ops, _ = select_ops(_preference(target.ops), config.head_dim, target.device, target.dtype)
    weights = load_weights(directory, config, target.dtype, quantization)
    model = DecoderModel(config, weights, ops, target.device, target.dtype, max_len)
    del weights
    host_memory.trim()
    log.info(
        "drafter loaded: %s (%s)", directory, ", ".join(f"{n} {k}" for k, n in model.weight_formats.items())
    )
    return model


def _preference(ops: TorchOps) -> str:
    return ops.name if ops.name in ("native", "triton", "torch") else "auto"


def _draft_config(path: Path, target: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The draft checkpoint's config, once its tokenizer is known to be the target's."""
    try:
        config = ModelConfig.from_dir(path)
        draft_tokenizer = Tokenizer.from_dir(path)
    except (CheckpointError, OSError, ValueError) as exc:
        raise ConfigError(f"speculative: draft checkpoint {str(path)!r} cannot be read: {exc}") from exc
    if config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative: draft checkpoint {str(path)!r} has vocab_size {config.vocab_size}, the "
            f"model {target.vocab_size}; a drafter must share the model's tokenizer and vocabulary"
        )
    ours = tokenizer.backend.get_vocab(with_added_tokens=True)
    theirs = draft_tokenizer.backend.get_vocab(with_added_tokens=True)
    if ours != theirs:
        differing = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise ConfigError(
            f"speculative: draft checkpoint {str(path)!r} has a different tokenizer vocabulary "
            f"({len(theirs)} tokens against {len(ours)}; e.g. {differing}); a drafter must share the "
            "model's tokenizer"
        )
    return config
