"""Preparation's configuration (EXPERT_* variables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.auth.config import AuthConfig
from libs.config import EnvReader, ServerConfig

DEFAULT_PORT = 50053
DEFAULT_METRICS_PORT = 9153


@dataclass(frozen=True)
class PreparationConfig:
    server: ServerConfig
    heartbeat_interval_s: float  # what engines are told to use
    engine_timeout_s: float  # an engine silent this long is dropped
    store_dir: str  # the expert store packages are staged from
    max_hot_experts: int  # experts an engine keeps hot at most (docs/design.md#budget-check)
    stage_chunk_bytes: int  # LoadExpert message size
    stage_timeout_s: float  # longest one LoadExpert may take
    auth: AuthConfig = field(default_factory=AuthConfig)  # EXPERT_AUTH, EXPERT_INTERNAL_TOKEN

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PreparationConfig:
        reader = EnvReader(env)
        interval = reader.number("EXPERT_PREPARATION_HEARTBEAT_SECONDS", 2.0, minimum=0.05)
        return cls(
            server=ServerConfig.from_env("preparation", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            auth=AuthConfig.from_env(env),
            heartbeat_interval_s=interval,
            engine_timeout_s=reader.number(
                "EXPERT_PREPARATION_ENGINE_TIMEOUT_SECONDS", 3 * interval, minimum=interval
            ),
            store_dir=reader.text("EXPERT_STORE", "data/experts"),
            max_hot_experts=reader.integer("EXPERT_PREPARATION_MAX_HOT_EXPERTS", 20, minimum=1),
            stage_chunk_bytes=reader.integer(
                "EXPERT_PREPARATION_STAGE_CHUNK_BYTES", 1 << 20, minimum=1024, maximum=3 << 20
            ),
            stage_timeout_s=reader.number("EXPERT_PREPARATION_STAGE_TIMEOUT_SECONDS", 60.0, minimum=1.0),
        )
