"""The engine service's configuration: the gRPC server, the engine itself, and its place in the fleet."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.auth.config import AuthConfig
from libs.config import EnvReader, ServerConfig, local_host
from libs.engine.config import EngineConfig

DEFAULT_PORT = 50054
DEFAULT_METRICS_PORT = 9154


@dataclass(frozen=True)
class EngineServiceConfig:
    server: ServerConfig
    engine: EngineConfig
    engine_id: str
    advertise_address: str  # where preparation and dispatchers reach this engine
    preparation_target: str
    heartbeat_interval_s: float
    stream_buffer: int  # outputs a slow client's stream holds before they are merged
    max_expert_bytes: int  # largest package LoadExpert accepts
    auth: AuthConfig = field(default_factory=AuthConfig)  # EXPERT_AUTH, EXPERT_INTERNAL_TOKEN

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineServiceConfig:
        reader = EnvReader(env)
        server = ServerConfig.from_env("engine", DEFAULT_PORT, DEFAULT_METRICS_PORT, env)
        return cls(
            server=server,
            auth=AuthConfig.from_env(env),
            engine=EngineConfig.from_env(env),
            engine_id=reader.text("EXPERT_ENGINE_ID", f"{socket.gethostname()}-{server.port}"),
            advertise_address=reader.text(
                "EXPERT_ENGINE_ADVERTISE_ADDRESS", f"{local_host(server.bind_host)}:{server.port}"
            ),
            preparation_target=reader.address("EXPERT_PREPARATION_TARGET", "127.0.0.1:50053"),
            heartbeat_interval_s=reader.number("EXPERT_ENGINE_HEARTBEAT_SECONDS", 2.0, minimum=0.1),
            stream_buffer=reader.integer("EXPERT_ENGINE_STREAM_BUFFER", 64, minimum=1),
            max_expert_bytes=reader.integer("EXPERT_ENGINE_MAX_EXPERT_BYTES", 2 << 30, minimum=1),
        )
