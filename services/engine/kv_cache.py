"""Sizing and allocating the KV cache: one pre-allocated tensor holding every layer's block pool."""

from __future__ import annotations

import logging

import torch

from services.engine.config import CacheConfig, ConfigError
from services.engine.models.config import ModelConfig

log = logging.getLogger(__name__)


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return model.kv_bytes_per_token(element) * block_size


def available_memory(device: torch.device) -> int:
    """Bytes the cache may draw from: free GPU memory, or MemAvailable on the host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ConfigError(
        "kv cache: cannot read available memory; set EXPERT_KV_CACHE_BYTES or EXPERT_KV_NUM_BLOCKS"
    )


def plan_num_blocks(
    cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device, max_tokens_needed: int
) -> int:
    """Blocks to allocate (the reserved null block included).

    An explicit count wins, then a byte budget, then a fraction of available memory; the automatic
    sizes are capped at what `max_tokens_needed` tokens (every sequence at full length) could use.
    """
    per_block = bytes_per_block(model, cache.block_size, dtype)
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_bytes is not None:
        blocks = cache.kv_cache_bytes // per_block
        if blocks < 2:
            raise ConfigError(
                f"kv_cache_bytes: {cache.kv_cache_bytes} bytes hold fewer than 2 blocks of {per_block} bytes"
            )
        return blocks
    budget = int(available_memory(device) * cache.memory_fraction)
    cap = -(-max_tokens_needed // cache.block_size) + 1
    blocks = min(budget // per_block, cap)
    if blocks < 2:
        raise ConfigError(
            f"memory_fraction: {cache.memory_fraction} of available memory holds fewer than 2 "
            f"KV blocks of {per_block} bytes"
        )
    return blocks


def allocate(
    num_blocks: int, model: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[layers, 2 (K, V), blocks, kv_heads, block_size, head_dim], zeroed so that padding reads zeros."""
    shape = (model.num_layers, 2, num_blocks, model.num_kv_heads, block_size, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
