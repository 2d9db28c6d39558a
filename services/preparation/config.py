"""Preparation's configuration (EXPERT_* variables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from libs.config import EnvReader, ServerConfig

DEFAULT_PORT = 50053
DEFAULT_METRICS_PORT = 9153


@dataclass(frozen=True)
class PreparationConfig:
    server: ServerConfig
    heartbeat_interval_s: float  # what engines are told to use
    engine_timeout_s: float  # an engine silent this long is dropped

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PreparationConfig:
        reader = EnvReader(env)
        interval = reader.number("EXPERT_PREPARATION_HEARTBEAT_SECONDS", 2.0, minimum=0.05)
        return cls(
            server=ServerConfig.from_env("preparation", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            heartbeat_interval_s=interval,
            engine_timeout_s=reader.number(
                "EXPERT_PREPARATION_ENGINE_TIMEOUT_SECONDS", 3 * interval, minimum=interval
            ),
        )
