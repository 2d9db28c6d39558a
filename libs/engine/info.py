"""What an engine says about itself to those who place work on it: the model it serves and its
limits (`ModelInfo`, fixed once the model is loaded), and how busy it is (`EngineLoad`, from a
stats snapshot). The engine service reports both to the fleet; they are plain data, so a server
copies fields and never reads the engine's own objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from libs.engine.outputs import EngineStats
from libs.experts.manifest import BaseModelIdentity


@dataclass(frozen=True)
class ModelInfo:
    """The model an engine serves and the limits it was built with."""

    name: str  # the name it is served under: served_model_name, else the checkpoint directory's name
    base_model: BaseModelIdentity  # which experts fit it (their manifests' base_model)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # of the weights and the KV cache: "float32", "bfloat16" or "float16"
    dtype_bytes: int
    kv_cache_dtype: str  # of the KV cache: the model's dtype, or "int8" (codes and a scale per row)
    # K and V of one block across all layers, as allocated (scales included), with the model
    # drafter's block that goes with it when there is one
    kv_bytes_per_block: int
    max_model_len: int  # the context window: prompt and output tokens of one sequence
    block_size: int  # tokens per KV block
    max_num_seqs: int  # sequences that run at once
    max_sessions: int  # sessions whose KV the engine keeps between turns
    kernels: str  # the operator set the model runs with
    weight_formats: Mapping[str, int]  # linear weights (the LM head included) per format
    sampling_defaults: Mapping[str, float | int]  # the checkpoint's generation_config.json values


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is and how much more it can take, as placement reads it.

    The KV counts partition the pool (the block pool owns them): total = used + cached + free."""

    kv_blocks_total: int
    kv_blocks_used: int  # held by running and waiting sequences
    kv_blocks_cached: int  # reusable KV nothing running holds, given up when a sequence needs it
    kv_blocks_free: int  # empty blocks
    kv_blocks_sessions: int  # blocks idle sessions keep between turns (within kv_blocks_cached)
    running: int
    waiting: int
    max_num_seqs: int
    sessions: int
    max_sessions: int

    @property
    def kv_blocks_available(self) -> int:
        """What new work can have without preempting anything."""
        return self.kv_blocks_free + self.kv_blocks_cached

    @classmethod
    def of(cls, stats: EngineStats, model: ModelInfo) -> EngineLoad:
        """The load a stats snapshot shows, against the limits the engine was built with."""
        sessions = stats.sessions
        return cls(
            kv_blocks_total=stats.kv_num_blocks,
            kv_blocks_used=stats.kv_used_blocks,
            kv_blocks_cached=stats.kv_cached_blocks,
            kv_blocks_free=stats.kv_free_blocks,
            kv_blocks_sessions=stats.kv_session_blocks,
            running=stats.num_running,
            waiting=stats.num_waiting,
            max_num_seqs=model.max_num_seqs,
            sessions=sessions.sessions,
            max_sessions=model.max_sessions,
        )
