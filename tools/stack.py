"""The whole system on one machine: a redis-server and the five services as processes, and with
`trainer=True` the trainer worker (started last, stopped first).

`make run` (through `expertctl up`) and the end-to-end tests both use it. Services start in
dependency order and are ready when their grpc.health.v1 check says SERVING; each writes its JSON
logs to a file under `log_dir`. Stopping sends SIGTERM (the services stop gracefully) and SIGKILL
to what is still running after a grace period.

The services listen on 127.0.0.1 (EXPERT_BIND_HOST moves them), and every target names that very
address, never `localhost`, which may resolve to ::1 too, where another user's process could listen.
Each process is tied to the one that started the stack (tools.child_process): if it dies, SIGKILL
included, they stop too.

The redis-server it starts listens on 127.0.0.1 only, asks for a password generated for the stack
(tools.local_redis; the services get it in EXPERT_REDIS_URL), keeps its directory readable by the
owner only, and has a memory cap (`redis_maxmemory`) and the volatile-ttl policy: only keys with
a TTL (job records, job event streams) can be evicted, never the queue streams, their consumer
groups or the dead-letter stream, which have none. It keeps nothing on disk unless
`redis_durable`, which turns on the append-only file (fsync every second) in `redis_dir`, so that
a restarted Redis reloads the queue and the job records.

With EXPERT_AUTH=required (in `env` or the environment) and no EXPERT_TLS_* given, it makes a local
CA and a certificate per service in `tls_dir` (tools.local_ca: owner-only files) and gives each
service its own, so that they call each other over mutual TLS; it checks their health with a
certificate of its own, CLIENT_IDENTITY, which `channel()` also presents (tests, operators' tools).
Reception's public port asks for no certificate (clients bring API keys).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.config import LOOPBACK_HOST, TLS_SETTINGS, TlsConfig, local_host
from libs.tls import channel_credentials
from tools import local_ca, local_redis
from tools.child_process import spawn

# Start order: the engine registers with preparation; reception calls all the others.
SERVICES = ("router", "preparation", "postproc", "engine", "reception")
TRAINER = "trainer"  # the training worker: only in stacks that ask for it (it loads torch and peft)
DEFAULT_PORTS = {
    "reception": 50051,
    "router": 50052,
    "preparation": 50053,
    "engine": 50054,
    "postproc": 50055,
}
DEFAULT_METRICS_PORTS = {
    "reception": 9151,
    "router": 9152,
    "preparation": 9153,
    "engine": 9154,
    "postproc": 9155,
}
TRAINER_PORT, TRAINER_METRICS_PORT = 50056, 9156  # the trainer's defaults (services/trainer/config.py)
# The services that also serve HTTP (reception: the OpenAI API and the probes), by default here.
DEFAULT_HTTP_PORTS = {"reception": 8080}
REDIS = "redis"  # the name of this stack's redis-server among its processes (its log: redis.log)
DEFAULT_REDIS_MAXMEMORY = "512mb"
# The certificate the launcher itself presents to the services (health checks, `channel()`).
CLIENT_IDENTITY = "client"
# The services whose gRPC port is public: clients bring API keys, no certificate, and no TLS.
PUBLIC_SERVICES = frozenset({"reception"})


class StackError(RuntimeError):
    """The stack could not start: a missing program, a service that died or never became ready."""


def free_port() -> int:
    """A TCP port that nothing listens on right now, for a server about to start.

    Picked below the kernel's ephemeral range (where the OS would pick with port 0): the outgoing
    connections of every client on the machine take ports from that range, so a port chosen there
    can be taken by one before the server binds it. A port is never handed out twice by a process.
    """
    low, _ = _ephemeral_range()
    for _ in range(1000):
        port = random.randrange(PORT_RANGE_START, max(PORT_RANGE_START + 1000, low))
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))  # the services' default bind address
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise StackError("no free TCP port found")


PORT_RANGE_START = 20000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def health_status(
    target: str, timeout: float = 1.0, credentials: grpc.ChannelCredentials | None = None
) -> int | None:
    """The health status of a gRPC server's "" service, or None if it does not answer; with
    `credentials`, over (mutual) TLS."""
    try:
        with _channel(target, credentials) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
            return response.status
    except grpc.RpcError:
        return None


def _channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials)


@dataclass
class LocalStack:
    log_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)  # extra EXPERT_* settings for every service
    ports: dict[str, int] = field(default_factory=lambda: {**DEFAULT_PORTS, TRAINER: TRAINER_PORT})
    metrics_ports: dict[str, int] = field(
        default_factory=lambda: {**DEFAULT_METRICS_PORTS, TRAINER: TRAINER_METRICS_PORT}
    )
    http_ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_HTTP_PORTS))  # 0: HTTP off
    redis_url: str | None = None  # an existing Redis; None starts a redis-server
    redis_durable: bool = False  # the redis-server it starts keeps an append-only file
    redis_dir: Path | None = None  # where that file goes; None: log_dir/redis
    redis_maxmemory: str = DEFAULT_REDIS_MAXMEMORY  # as redis-server's --maxmemory takes it
    tls_dir: Path | None = None  # where the local CA's certificates go; None: log_dir/tls
    trainer: bool = False  # also run the trainer worker (training jobs)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _redis: subprocess.Popen | None = None
    _redis_password: str | None = field(default=None, repr=False)  # of the redis-server it starts
    # The certificates it made (by service, and CLIENT_IDENTITY), when the services use mutual TLS.
    _identities: dict[str, local_ca.Identity] | None = field(default=None, repr=False)
    _client_tls: TlsConfig | None = field(default=None, repr=False)
    # How each process in `processes` was started (service, env overrides), to start it again.
    _launches: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict, repr=False)

    @classmethod
    def on_free_ports(cls, log_dir: Path, **kwargs) -> LocalStack:
        """A stack that can run next to another one (tests): every port picked free, metrics off,
        its own data directory (the router's embedded Qdrant) under `log_dir`."""
        env = {"EXPERT_DATA_DIR": str(Path(log_dir) / "data"), **kwargs.pop("env", {})}
        return cls(
            log_dir,
            env=env,
            ports={s: free_port() for s in (*SERVICES, TRAINER)},
            metrics_ports=dict.fromkeys((*SERVICES, TRAINER), 0),
            http_ports={s: free_port() for s in DEFAULT_HTTP_PORTS},
            **kwargs,
        )

    @property
    def bind_host(self) -> str:
        """Where the services listen: EXPERT_BIND_HOST from `env` or the environment, else 127.0.0.1."""
        return ({**os.environ, **self.env}.get("EXPERT_BIND_HOST") or "").strip() or LOOPBACK_HOST

    @property
    def auth_required(self) -> bool:
        """Whether EXPERT_AUTH (from `env` or the environment) is `required`."""
        return ({**os.environ, **self.env}.get("EXPERT_AUTH") or "").strip().lower() == "required"

    def identities(self) -> dict[str, local_ca.Identity]:
        """The certificates this stack gives its services, made on first use: with auth required
        and no EXPERT_TLS_* given, one per service and CLIENT_IDENTITY from a new local CA; else none."""
        if self._identities is None:
            given = any(({**os.environ, **self.env}.get(name) or "").strip() for name in TLS_SETTINGS)
            if not self.auth_required or given:
                self._identities = {}
            else:
                directory = self.tls_dir if self.tls_dir is not None else self.log_dir / "tls"
                hosts = [local_host(self.bind_host)] if self.bind_host != LOOPBACK_HOST else []
                self._identities = local_ca.issue(directory, [*SERVICES, TRAINER, CLIENT_IDENTITY], hosts)
        return self._identities

    def client_credentials(self) -> grpc.ChannelCredentials | None:
        """What a client of this stack's internal ports presents: CLIENT_IDENTITY's certificate when
        the stack made them, the one EXPERT_TLS_* name when they were given (every service has it
        then), None (plaintext) without TLS."""
        if self._client_tls is None:  # read once: the stack checks health every tenth of a second
            identity = self.identities().get(CLIENT_IDENTITY)
            self._client_tls = TlsConfig.from_env(identity.env() if identity else {**os.environ, **self.env})
        return None if self._client_tls is None else channel_credentials(self._client_tls)

    def _credentials_for(self, name: str) -> grpc.ChannelCredentials | None:
        """What the stack presents to the process `name`: nothing to a public port."""
        service = self._launches.get(name, (name, {}))[0]
        return None if service in PUBLIC_SERVICES else self.client_credentials()

    def channel(self, target: str) -> grpc.Channel:
        """A blocking channel to `target` (a service's internal port), with this stack's client
        certificate when its services use mutual TLS."""
        return _channel(target, self.client_credentials())

    def target(self, service: str) -> str:
        """Where the services and the clients on this machine call `service`: the very address it
        listens on (127.0.0.1 by default), never a name that may resolve elsewhere."""
        return f"{local_host(self.bind_host)}:{self.ports[service]}"

    def http_url(self, service: str = "reception") -> str:
        """The base URL of a service's HTTP server (reception's OpenAI API: http_url() + "/v1")."""
        port = self.http_ports.get(service, 0)
        if not port:
            raise StackError(f"{service} serves no HTTP in this stack")
        return f"http://{local_host(self.bind_host)}:{port}"

    def service_env(self) -> dict[str, str]:
        env = {**os.environ, "EXPERT_REDIS_URL": self.redis_url or "", **self.env}
        env["EXPERT_BIND_HOST"] = self.bind_host
        for service in [s for s in (*SERVICES, TRAINER) if s in self.ports]:
            name = service.upper()
            env[f"EXPERT_{name}_PORT"] = str(self.ports[service])
            env[f"EXPERT_{name}_METRICS_PORT"] = str(self.metrics_ports[service])
        for service, port in self.http_ports.items():
            env[f"EXPERT_{service.upper()}_HTTP_PORT"] = str(port)
        env |= {
            "EXPERT_ROUTER_TARGET": self.target("router"),
            "EXPERT_PREPARATION_TARGET": self.target("preparation"),
            "EXPERT_POSTPROC_TARGET": self.target("postproc"),
            "EXPERT_ENGINE_ADVERTISE_ADDRESS": self.target("engine"),
        }
        if not env.get("EXPERT_AUDIT_LOG", "").strip():  # beside the logs, not in reception's
            env["EXPERT_AUDIT_LOG"] = str(Path(self.log_dir).resolve() / "audit.log")
        return env

    def start(self, timeout: float = 180.0) -> None:
        """Start Redis (unless given) and the services, and wait until every one is SERVING."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.redis_url is None:
                self.start_redis()
            started = (*SERVICES, TRAINER) if self.trainer else SERVICES
            for service in started:
                self.start_service(service)
            for service in started:
                self.wait_serving(service, timeout)
        except BaseException:
            self.stop()
            raise

    def start_redis(self, port: int | None = None, timeout: float = 60.0) -> None:
        """Start a redis-server for this stack on `port`, or a free one (its URL becomes
        `redis_url`), and wait until it answers (a durable one first loads its append-only file)."""
        port = self._spawn_redis(port or free_port())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._redis.poll() is not None:
                raise StackError(
                    f"redis-server exited with status {self._redis.returncode}; see {self.log_path(REDIS)}"
                )
            if local_redis.answers(self.redis_url):
                return
            time.sleep(0.05)
        raise StackError(f"redis-server did not answer on port {port}; see {self.log_path(REDIS)}")

    def _redis_command(self, program: str, port: int) -> list[str]:
        """The redis-server command line: the rest of its settings from stdin (`-`: the password),
        127.0.0.1 only, the memory cap, and the append-only file (fsync every second) when durable;
        RDB snapshots are off either way."""
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.redis_durable else []
        return [
            program,
            "-",
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(self._redis_dir())),
            *("--maxmemory", self.redis_maxmemory, "--maxmemory-policy", "volatile-ttl"),
            *("--save", ""),
            *(persistence or ["--appendonly", "no"]),
        ]

    def _redis_dir(self) -> Path:
        return self.redis_dir if self.redis_dir is not None else self.log_dir / REDIS

    def _spawn_redis(self, port: int) -> int:
        program = shutil.which("redis-server")
        if program is None:
            raise StackError(
                "redis-server is not installed (apt-get install redis-server), or set EXPERT_REDIS_URL"
            )
        directory = local_redis.private_dir(self._redis_dir())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._redis_password is None:  # one per stack: a restarted redis-server keeps it
            self._redis_password = local_redis.new_password()
        local_redis.keep_password(directory, self._redis_password)
        self._redis = spawn(
            self._redis_command(program, port),
            self.log_path(REDIS),
            stdin_text=local_redis.config_text(self._redis_password),
            umask=local_redis.REDIS_UMASK,
        )
        self.redis_url = local_redis.url(port, self._redis_password)
        return port

    def start_service(
        self, service: str, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        """Start `service` as the process `name` (default: the service's own name)."""
        name = name or service
        self.log_dir.mkdir(parents=True, exist_ok=True)
        process = spawn(
            [sys.executable, "-m", f"services.{service}"],
            self.log_path(name),
            env={**self.service_env(), **self._tls_env(service), **(env or {})},
        )
        self.processes[name] = process
        self._launches[name] = (service, dict(env or {}))
        return process

    def _tls_env(self, service: str) -> dict[str, str]:
        identity = self.identities().get(service)
        return identity.env() if identity is not None else {}

    def log_path(self, name: str) -> Path:
        """The log file of the process `name` (a service, an extra engine, or REDIS)."""
        return self.log_dir / f"{name}.log"

    def supervised(self) -> dict[str, subprocess.Popen]:
        """The processes this stack started, by name: the services, the extra engines, and its
        redis-server as REDIS (if it started one)."""
        redis = {REDIS: self._redis} if self._redis is not None else {}
        return {**self.processes, **redis}

    def restart(self, name: str) -> None:
        """Start the process `name`, which has exited, again as it was first started: a service
        with the same settings and ports; this stack's redis-server on the same port and directory
        (a durable one reloads its append-only file). Does not wait until it is ready."""
        process = self.supervised().get(name)
        if process is None:
            raise StackError(f"{name} is not a process of this stack")
        if process.poll() is None:
            raise StackError(f"{name} is still running")
        if name == REDIS:
            self._spawn_redis(urlparse(self.redis_url).port)
        else:
            service, env = self._launches[name]
            self.start_service(service, name, env)

    def ready(self, name: str) -> bool:
        """Whether the process `name` answers: PONG from Redis, SERVING from a service."""
        if name == REDIS:
            return self.redis_url is not None and local_redis.answers(self.redis_url)
        status = health_status(self.target(name), timeout=0.25, credentials=self._credentials_for(name))
        return status == health_pb2.HealthCheckResponse.SERVING

    def start_engine(
        self, engine_id: str, timeout: float = 180.0, env: Mapping[str, str] | None = None
    ) -> str:
        """Another engine process (a second accelerator) that joins this stack's fleet as
        `engine_id`, with `env` over the stack's settings (EXPERT_MODEL_PATH: another model);
        returns its target once it is SERVING."""
        port = free_port()
        self.ports[engine_id] = port
        self.start_service(
            "engine",
            engine_id,
            {
                "EXPERT_ENGINE_PORT": str(port),
                "EXPERT_ENGINE_METRICS_PORT": "0",
                "EXPERT_ENGINE_ID": engine_id,
                "EXPERT_ENGINE_ADVERTISE_ADDRESS": self.target(engine_id),
                **(env or {}),
            },
        )
        self.wait_serving(engine_id, timeout)
        return self.target(engine_id)

    def wait_serving(self, service: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        process = self.processes[service]
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise StackError(
                    f"{service} exited with status {process.returncode}; see {self.log_path(service)}"
                )
            status = health_status(self.target(service), credentials=self._credentials_for(service))
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise StackError(f"{service} was not SERVING after {timeout:.0f} s; see {self.log_path(service)}")

    def kill(self, service: str) -> None:
        """SIGKILL: the service dies without cleaning up (for failure tests)."""
        process = self.processes.pop(service)
        process.kill()
        process.wait()

    def stop_service(self, service: str, grace: float = 15.0) -> None:
        process = self.processes.pop(service, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop(self) -> None:
        """Stop the extra engines and the services in reverse order, then Redis (if this stack
        started it)."""
        for name in [n for n in self.processes if n not in SERVICES]:
            self.stop_service(name)
        for service in reversed(SERVICES):
            self.stop_service(service)
        if self._redis is not None:
            self._redis.terminate()
            self._redis.wait(timeout=10)
            self._redis = None

    def restart_redis(self, down_s: float = 0.0) -> None:
        """Kill this stack's redis-server (SIGKILL: unless durable, it keeps nothing) and start a
        new one on the same port and directory after `down_s` seconds (for failure tests); a
        durable one reloads its append-only file."""
        if self._redis is None or self.redis_url is None:
            raise StackError("this stack did not start its Redis")
        self._redis.kill()
        self._redis.wait()
        time.sleep(down_s)
        self.start_redis(port=urlparse(self.redis_url).port)

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
