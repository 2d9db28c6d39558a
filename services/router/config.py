"""The router's configuration (EXPERT_* variables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from libs.config import EnvReader, ServerConfig

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9152


@dataclass(frozen=True)
class RouterConfig:
    server: ServerConfig
    data_dir: str  # embedded Qdrant lives in <data_dir>/qdrant
    qdrant_url: str  # a Qdrant server instead ("" for embedded)
    prior_success_rate: float  # what a new expert's success rate starts from
    redis_url: str  # the feedback stream
    feedback_alpha: float  # weight of one job's outcome in an expert's success rate
    encoder_threads: int  # torch threads of the sentence encoder

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterConfig:
        reader = EnvReader(env)
        return cls(
            server=ServerConfig.from_env("router", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            data_dir=reader.text("EXPERT_DATA_DIR", "data"),
            qdrant_url=reader.text("EXPERT_QDRANT_URL", ""),
            prior_success_rate=reader.number(
                "EXPERT_ROUTER_PRIOR_SUCCESS_RATE", 0.5, minimum=0.0, maximum=1.0
            ),
            redis_url=reader.text("EXPERT_REDIS_URL", "redis://localhost:6379/0"),
            feedback_alpha=reader.number("EXPERT_ROUTER_FEEDBACK_ALPHA", 0.1, minimum=0.001, maximum=1.0),
            encoder_threads=reader.integer("EXPERT_ROUTER_ENCODER_THREADS", 1, minimum=1, maximum=256),
        )
