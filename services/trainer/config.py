"""The trainer's configuration (EXPERT_* variables)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from libs.auth.config import AuthConfig
from libs.config import ConfigError, EnvReader, ServerConfig
from libs.training.bounds import TrainingBounds
from libs.training.retention import DEFAULT_RETENTION_S, retention_from_env

DEFAULT_PORT = 50056
DEFAULT_METRICS_PORT = 9156
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainerConfig:
    server: ServerConfig
    redis_url: str
    model_path: Path  # the deployment's base model: every job trains an adapter of it
    served_model: str  # the name requests give it (EXPERT_SERVED_MODEL_NAME, else the directory's)
    signing_key: Path | None  # the publisher key the experts are signed with
    trusted_keys: Path  # the keys the store accepts (the signing key's public key among them)
    store: Path  # the expert store the experts go to (the one preparation stages from)
    router_target: str
    checkpoint_dir: Path
    checkpoint_steps: int  # a checkpoint every this many steps (a job may ask for another)
    lease_ms: int
    max_deliveries: int
    device: str  # "auto": CUDA when present, else the CPU
    consumer: str
    bounds: TrainingBounds = field(default_factory=TrainingBounds)
    # An ended job's record, events and checkpoint directory are kept this long.
    job_retention_s: int = DEFAULT_RETENTION_S
    auth: AuthConfig = field(default_factory=AuthConfig)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerConfig:
        reader = EnvReader(env)
        key = reader.text("EXPERT_TRAINER_SIGNING_KEY", "")
        device = reader.text("EXPERT_TRAINER_DEVICE", "auto")
        if device not in DEVICES and not device.startswith("cuda:"):
            raise ConfigError(f"EXPERT_TRAINER_DEVICE: expected auto, cpu, cuda or cuda:N, got {device!r}")
        model_path = Path(reader.text("EXPERT_MODEL_PATH", "data/models/SmolLM2-135M-Instruct"))
        return cls(
            server=ServerConfig.from_env("trainer", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            redis_url=reader.text("EXPERT_REDIS_URL", "redis://127.0.0.1:6379/0"),
            model_path=model_path,
            served_model=reader.text("EXPERT_SERVED_MODEL_NAME", model_path.name),
            signing_key=Path(key) if key else None,
            trusted_keys=Path(reader.text("EXPERT_TRUSTED_KEYS", "data/keys/trusted")),
            store=Path(reader.text("EXPERT_STORE", "data/experts")),
            router_target=reader.address("EXPERT_ROUTER_TARGET", "127.0.0.1:50052"),
            checkpoint_dir=Path(reader.text("EXPERT_TRAINER_CHECKPOINT_DIR", "data/training")),
            checkpoint_steps=reader.integer("EXPERT_TRAINER_CHECKPOINT_STEPS", 100, minimum=1),
            lease_ms=reader.integer("EXPERT_TRAINER_LEASE_MS", 30_000, minimum=100),
            max_deliveries=reader.integer("EXPERT_TRAINER_MAX_DELIVERIES", 3, minimum=1),
            device=device,
            consumer=reader.text("EXPERT_TRAINER_ID", f"{socket.gethostname()}-{os.getpid()}"),
            bounds=TrainingBounds.from_env(env),
            job_retention_s=retention_from_env(env),
            auth=AuthConfig.from_env(env),
        )
