"""Sizing and allocating the KV cache: one pre-allocated tensor holding every layer's block pool."""

from __future__ import annotations

import logging

import torch

from libs.engine import host_memory
from libs.engine.config import CacheConfig, ConfigError
from libs.engine.models.config import ModelConfig

log = logging.getLogger(__name__)


# An int8 cache row: head_dim codes, then the row's float32 scale (csrc/kv_int8.h).
INT8_SCALE_BYTES = 4


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's element type for EXPERT_KV_CACHE_DTYPE ("auto": the model's)."""
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def row_elements(model: ModelConfig, dtype: torch.dtype) -> int:
    """Elements one token of one KV head takes: head_dim, plus the scale's bytes in an int8 cache."""
    return model.head_dim + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers, in a cache of element type `dtype` (scales included)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * model.num_kv_heads * row_elements(model, dtype) * element


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across all layers."""
    return bytes_per_token(model, dtype) * block_size


def available_memory(device: torch.device) -> int:
    """Bytes the cache may draw from: free GPU memory; on the host, MemAvailable, or less when the
    process's cgroup (a container's memory limit) leaves less than that."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    host = _meminfo_available()
    if host is None:
        raise ConfigError(
            "kv cache: cannot read available memory; set EXPERT_KV_CACHE_BYTES or EXPERT_KV_NUM_BLOCKS"
        )
    limited = _cgroup_headroom()
    return host if limited is None else min(host, limited)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup minus its usage (cgroup v2, else v1), or None
    without a limit. Inside a container /proc/meminfo describes the host, so it alone could size
    the cache past the container's limit."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    candidates = []
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":  # v2: the unified hierarchy
            candidates.append((f"{root}{path}", "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((f"{root}/memory{path}", "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for directory, limit_file, usage_file in candidates:
        try:
            with open(f"{directory.rstrip('/')}/{limit_file}") as f:
                limit = f.read().strip()
            with open(f"{directory.rstrip('/')}/{usage_file}") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= _NO_LIMIT:
            continue
        return max(0, int(limit) - usage)
    return None


# cgroup v1 reports "no limit" as a page-rounded 2**63 − 1.
_NO_LIMIT = 1 << 62


def plan_num_blocks(
    cache: CacheConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens_needed: int,
    drafter_bytes_per_block: int = 0,
) -> int:
    """Blocks to allocate (the reserved null block included).

    An explicit count wins, then a byte budget, then a fraction of available memory; the automatic
    sizes are capped at what `max_tokens_needed` tokens (every sequence at full length) could use.
    A model drafter keeps as many blocks of its own (so it never runs short first): the budget pays
    for both, `drafter_bytes_per_block` more per block.
    """
    per_block = bytes_per_block(model, cache.block_size, dtype) + drafter_bytes_per_block
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
    """[layers, 2 (K, V), blocks, kv_heads, block_size, row], zeroed so that padding reads zeros.
    `row` is head_dim, or head_dim + 4 bytes in an int8 cache (codes, then the row's scale): a
    block's scales travel with its codes, so copying a block (copy-on-write) copies both.

    On the host the cache lives in huge pages: attention reads it a 4 KB block-head at a time from
    scattered blocks, one TLB miss each with ordinary pages.
    """
    shape = (model.num_layers, 2, num_blocks, model.num_kv_heads, block_size, row_elements(model, dtype))
    if device.type == "cpu":
        # Written once so that every page is resident now: short memory fails here, not mid-request.
        return host_memory.zeros(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)
