"""Postproc's configuration (EXPERT_* variables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.auth.config import AuthConfig
from libs.config import EnvReader, ServerConfig

DEFAULT_PORT = 50055
DEFAULT_METRICS_PORT = 9155


@dataclass(frozen=True)
class PostprocConfig:
    server: ServerConfig
    redis_url: str
    auth: AuthConfig = field(default_factory=AuthConfig)  # EXPERT_AUTH, EXPERT_INTERNAL_TOKEN

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PostprocConfig:
        reader = EnvReader(env)
        return cls(
            server=ServerConfig.from_env("postproc", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            auth=AuthConfig.from_env(env),
            redis_url=reader.text("EXPERT_REDIS_URL", "redis://127.0.0.1:6379/0"),
        )
