"""The router's configuration (EXPERT_* variables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from libs.config import ServerConfig

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9152


@dataclass(frozen=True)
class RouterConfig:
    server: ServerConfig

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterConfig:
        return cls(server=ServerConfig.from_env("router", DEFAULT_PORT, DEFAULT_METRICS_PORT, env))
