"""Reception's configuration (EXPERT_* variables): the API server, Redis, the stages, the dispatcher."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.auth.config import AuthConfig
from libs.config import EnvReader, ServerConfig
from libs.training.bounds import TrainingBounds
from libs.training.files import DEFAULT_MAX_BYTES as DEFAULT_TRAINING_FILE_MAX_BYTES
from libs.training.files import DEFAULT_MAX_PER_OWNER as DEFAULT_TRAINING_FILES_PER_OWNER
from libs.training.retention import DEFAULT_RETENTION_S, retention_from_env
from services.reception.dispatch.dispatcher import DispatchSettings
from services.reception.dispatch.pipeline import DEFAULT_STREAM_INTERVAL
from services.reception.http.body_guard import DEFAULT_MAX_BODY_BYTES
from services.reception.redis_compaction import DEFAULT_INTERVAL_S
from services.reception.sessions import SessionLimits
from services.reception.training_uploads import UploadLimits

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9151
DEFAULT_HTTP_PORT = 8080


@dataclass(frozen=True)
class ReceptionConfig:
    server: ServerConfig
    http_port: int  # the HTTP API (OpenAI's), on the server's bind host; 0: off
    redis_url: str
    router_target: str
    preparation_target: str
    postproc_target: str
    dispatch_enabled: bool  # off: an API-only instance (other instances dispatch)
    dispatch: DispatchSettings
    engine_retries: int
    stream_interval: int  # tokens per engine message for a job no client streams
    job_ttl_s: int
    drain_s: float  # on SIGTERM: how long the jobs running get to end before they are handed back
    store_text: bool  # keep prompts and outputs in the job records after the jobs end
    audit_log: str  # where the audit log goes: "off", "stdout" or a file path
    audit_clear_text: bool  # the audit lines carry the prompt and output, not only their SHA-256s
    sessions: SessionLimits = field(default_factory=lambda: SessionLimits(600.0, 0))
    session_stream_buffer: int = 256  # messages a session's stream may fall behind before its turn stops
    auth: AuthConfig = field(default_factory=AuthConfig)  # EXPERT_AUTH, EXPERT_INTERNAL_TOKEN
    http_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # an HTTP body over this is refused unread (413)
    # Training files (/v1/files, TrainingFileService): the largest, and how many one owner keeps.
    training_files: UploadLimits = field(
        default_factory=lambda: UploadLimits(
            DEFAULT_TRAINING_FILE_MAX_BYTES, DEFAULT_TRAINING_FILES_PER_OWNER
        )
    )
    # Without store_text: at most one rewrite of Redis's append-only file per this many seconds,
    # once ended jobs' texts left Redis (redis_compaction).
    redis_compact_s: float = DEFAULT_INTERVAL_S
    training: TrainingBounds = field(default_factory=TrainingBounds)  # a training job may ask at most
    training_retention_s: int = DEFAULT_RETENTION_S  # an ended training job's record is kept this long

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReceptionConfig:
        reader = EnvReader(env)
        default_timeout_ms = reader.integer("EXPERT_JOB_DEFAULT_TIMEOUT_MS", 600_000, minimum=0)
        return cls(
            server=ServerConfig.from_env("reception", DEFAULT_PORT, DEFAULT_METRICS_PORT, env),
            auth=AuthConfig.from_env(env),
            training=TrainingBounds.from_env(env),
            training_retention_s=retention_from_env(env),
            http_port=reader.integer(
                "EXPERT_RECEPTION_HTTP_PORT", DEFAULT_HTTP_PORT, minimum=0, maximum=65535
            ),
            http_max_body_bytes=reader.integer(
                "EXPERT_HTTP_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, minimum=1024
            ),
            training_files=UploadLimits(
                max_bytes=reader.integer(
                    "EXPERT_TRAINING_FILE_MAX_BYTES", DEFAULT_TRAINING_FILE_MAX_BYTES, minimum=1024
                ),
                max_per_owner=reader.integer(
                    "EXPERT_TRAINING_FILES_PER_OWNER", DEFAULT_TRAINING_FILES_PER_OWNER, minimum=0
                ),
            ),
            redis_url=reader.text("EXPERT_REDIS_URL", "redis://127.0.0.1:6379/0"),
            router_target=reader.address("EXPERT_ROUTER_TARGET", "127.0.0.1:50052"),
            preparation_target=reader.address("EXPERT_PREPARATION_TARGET", "127.0.0.1:50053"),
            postproc_target=reader.address("EXPERT_POSTPROC_TARGET", "127.0.0.1:50055"),
            dispatch_enabled=reader.boolean("EXPERT_DISPATCH_ENABLED", True),
            dispatch=DispatchSettings(
                max_jobs=reader.integer("EXPERT_DISPATCH_MAX_JOBS", 1024, minimum=1),
                reclaim_idle_ms=reader.integer("EXPERT_DISPATCH_RECLAIM_IDLE_MS", 15_000, minimum=100),
                max_deliveries=reader.integer("EXPERT_DISPATCH_MAX_DELIVERIES", 3, minimum=1),
                default_timeout_s=default_timeout_ms / 1000 if default_timeout_ms else None,
                sweep_grace_s=reader.number("EXPERT_DISPATCH_SWEEP_GRACE_SECONDS", 30.0, minimum=0.0),
            ),
            engine_retries=reader.integer("EXPERT_DISPATCH_ENGINE_RETRIES", 2, minimum=0),
            stream_interval=reader.integer(
                "EXPERT_DISPATCH_STREAM_INTERVAL", DEFAULT_STREAM_INTERVAL, minimum=1
            ),
            job_ttl_s=reader.integer("EXPERT_JOB_TTL_SECONDS", 86_400, minimum=1),
            drain_s=reader.number("EXPERT_RECEPTION_DRAIN_SECONDS", 10.0, minimum=0.0),
            store_text=reader.boolean("EXPERT_STORE_REQUEST_TEXT", True),
            redis_compact_s=reader.number("EXPERT_REDIS_COMPACT_SECONDS", DEFAULT_INTERVAL_S, minimum=1.0),
            audit_log=_audit_destination(reader.text("EXPERT_AUDIT_LOG", "stdout")),
            audit_clear_text=reader.boolean("EXPERT_AUDIT_CLEAR_TEXT", False),
            sessions=SessionLimits(
                idle_seconds=reader.number("EXPERT_SESSION_IDLE_SECONDS", 600.0, minimum=1.0),
                max_tokens=reader.integer("EXPERT_SESSION_MAX_TOKENS", 0, minimum=0),
                max_per_key=reader.integer("EXPERT_SESSION_MAX_PER_KEY", 100, minimum=0),
                create_per_minute=reader.integer("EXPERT_SESSION_CREATE_PER_MINUTE", 60, minimum=0),
            ),
            session_stream_buffer=reader.integer("EXPERT_SESSION_STREAM_BUFFER", 256, minimum=1),
        )


def _audit_destination(value: str) -> str:
    """EXPERT_AUDIT_LOG: `off` and `stdout` in any case, else a file path as given."""
    return value.lower() if value.lower() in ("off", "stdout") else value
