"""The router's configuration (EXPERT_* variables)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.auth.config import AuthConfig
from libs.config import ConfigError, EnvReader, ServerConfig
from services.router.calibration import CALIBRATED, FloorRule
from services.router.matching import MatchRule
from services.router.tuning import DEFAULT_MAX_TOKENS_CEILING

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
    floor: FloorRule  # the similarity retrieval needs (calibrated per expert, or fixed)
    matching: MatchRule  # the author's words, the topic gate and the companion ratio
    max_tokens_ceiling: int  # the tuned max_tokens at most, when the user set none
    auth: AuthConfig = field(default_factory=AuthConfig)  # EXPERT_AUTH, EXPERT_INTERNAL_TOKEN

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterConfig:
        reader = EnvReader(env)
        return cls(
            server=ServerConfig.from_env("router", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            auth=AuthConfig.from_env(env),
            data_dir=reader.text("EXPERT_DATA_DIR", "data"),
            qdrant_url=reader.text("EXPERT_QDRANT_URL", ""),
            prior_success_rate=reader.number(
                "EXPERT_ROUTER_PRIOR_SUCCESS_RATE", 0.5, minimum=0.0, maximum=1.0
            ),
            redis_url=reader.text("EXPERT_REDIS_URL", "redis://127.0.0.1:6379/0"),
            feedback_alpha=reader.number("EXPERT_ROUTER_FEEDBACK_ALPHA", 0.1, minimum=0.001, maximum=1.0),
            encoder_threads=reader.integer("EXPERT_ROUTER_ENCODER_THREADS", 1, minimum=1, maximum=256),
            floor=FloorRule(
                fixed=_fixed_floor(reader.text("EXPERT_ROUTER_SIMILARITY_FLOOR", CALIBRATED)),
                quantile=reader.number(
                    "EXPERT_ROUTER_FLOOR_QUANTILE", FloorRule.quantile, minimum=0.5, maximum=1.0
                ),
                margin=reader.number(
                    "EXPERT_ROUTER_FLOOR_MARGIN", FloorRule.margin, minimum=-1.0, maximum=1.0
                ),
            ),
            matching=MatchRule(
                word_weight=reader.number(
                    "EXPERT_ROUTER_WORD_WEIGHT", MatchRule.word_weight, minimum=0.0, maximum=1.0
                ),
                topic_gate=reader.boolean("EXPERT_ROUTER_TOPIC_GATE", MatchRule.topic_gate),
                companion_ratio=reader.number(
                    "EXPERT_ROUTER_COMPANION_RATIO", MatchRule.companion_ratio, minimum=0.0, maximum=1.0
                ),
            ),
            max_tokens_ceiling=reader.integer(
                "EXPERT_ROUTER_MAX_TOKENS_DEFAULT", DEFAULT_MAX_TOKENS_CEILING, minimum=1
            ),
        )


def _fixed_floor(value: str) -> float | None:
    """`calibrated` -> None; a number in [-1, 1] -> that fixed floor."""
    if value.lower() == CALIBRATED:
        return None
    try:
        floor = float(value)
    except ValueError:
        floor = math.nan
    if not -1.0 <= floor <= 1.0:
        raise ConfigError(
            f"EXPERT_ROUTER_SIMILARITY_FLOOR: expected {CALIBRATED!r} or a cosine similarity in [-1, 1], "
            f"got {value!r}"
        )
    return floor
