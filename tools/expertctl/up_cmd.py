"""`expertctl up`: the whole system on this machine, until Ctrl-C.

Starts a redis-server (unless EXPERT_REDIS_URL names a running Redis) and the five services as
processes (tools.stack.LocalStack), with --trainer the trainer worker too (`make run` passes it),
waits until each reports SERVING, prints how to call it, then
keeps them running: a service or the redis-server that exits is started again after a backoff (1 s,
doubling up to 30 s, 1 s again once it has stayed up 60 s), each restart said in one line on stderr.
Ctrl-C or SIGTERM stops everything, prints how many restarts there were, and exits 0.

The services listen on 127.0.0.1 only, unless EXPERT_BIND_HOST is set, and are called there; the
redis-server always does, and asks for a password generated at each start (kept in
REDIS_DIR/password, for the owner only). It keeps an append-only file in REDIS_DIR (written every
second: a restart reloads the queue and the job records) and holds at most --redis-maxmemory,
evicting only keys that expire (job records and events), never the queue. Each service writes its
JSON logs to LOG_DIR/<service>.log. If up itself is killed, even with SIGKILL, its services and
redis-server are sent SIGTERM and stop.

The trainer signs the experts it trains with EXPERT_TRAINER_SIGNING_KEY; without one, up makes a
local publisher key once (KEYS_DIR/trainer/signing.key, beside the log directory: data/keys/trainer
under `make run`) and puts its public half among the trusted keys (EXPERT_TRUSTED_KEYS, default
data/keys/trusted), so that the engine accepts those experts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tools.expertctl.errors import UsageError

if TYPE_CHECKING:
    from tools.stack import LocalStack

DEFAULT_MODEL_DIR = Path("data/models/SmolLM2-135M-Instruct")
DEFAULT_LOG_DIR = Path("data/logs")
# What the services read when EXPERT_TRUSTED_KEYS is unset (relative to where up runs).
DEFAULT_TRUSTED_KEYS = Path("data/keys/trusted")
# The services listen here unless EXPERT_BIND_HOST is set: not reachable from other machines.
LOCAL_BIND_HOST = "127.0.0.1"
# Unless the user sets a budget: 1 GiB holds about 23,000 tokens of the default model in float32,
# plenty for a laptop, where the engine's default (20% of available memory) could take gigabytes.
DEFAULT_KV_CACHE_BYTES = 1 << 30
# Per service; the engine loads the model and may compile the C++ kernels (about 40 s) first.
START_TIMEOUT_S = 600.0
POLL_INTERVAL_S = 0.5
READY_LINE = "The Expert System is running"

_SETTING = re.compile(r"^(EXPERT_[A-Z0-9_]+)=(.*)$", re.DOTALL)
_MEMORY = re.compile(r"^[0-9]+([kmg]b?|b)?$", re.IGNORECASE)  # what redis-server's --maxmemory takes


class _StopRequested(BaseException):
    """Raised in the main thread by the first SIGINT or SIGTERM. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it; LocalStack.start
    stops what it started when one passes through."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="run the whole system locally until Ctrl-C", description=__doc__
    )
    parser.add_argument(
        "--model",
        type=Path,
        help=f"checkpoint directory for the engine (default $EXPERT_MODEL_PATH, else {DEFAULT_MODEL_DIR})",
    )
    parser.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR, help="where the services' logs go")
    parser.add_argument(
        "--redis-dir",
        type=Path,
        help="where the redis-server keeps its append-only file (default: redis beside the log "
        f"directory, {DEFAULT_LOG_DIR.parent / 'redis'} for the default one)",
    )
    parser.add_argument(
        "--redis-maxmemory",
        metavar="SIZE",
        help="the most memory the redis-server holds, e.g. 512mb or 2gb (default 512mb; 0: no cap)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EXPERT_* setting for every service (repeatable); EXPERT_<SERVICE>_PORT and "
        "EXPERT_<SERVICE>_METRICS_PORT move a service off its default port",
    )
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="also run the trainer worker (training jobs; `make run` passes this); it signs experts with "
        "EXPERT_TRAINER_SIGNING_KEY (from `expertctl expert keygen`, its .pub in EXPERT_TRUSTED_KEYS), "
        "else with a local key made once beside the log directory (keys/trainer/) and trusted",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tools.stack import StackError

    try:
        return _run(args)
    except StackError as exc:  # already one line that says what to do; not a bug's traceback
        _error(str(exc))
        return 1


def _run(args: argparse.Namespace) -> int:
    from tools.stack import DEFAULT_HTTP_PORTS, DEFAULT_REDIS_MAXMEMORY, SERVICES, TRAINER, LocalStack
    from tools.supervisor import Supervisor

    settings = _settings(os.environ, args.env)
    auth = _auth(settings)
    ports, metrics_ports = _ports(settings, (*SERVICES, TRAINER) if args.trainer else SERVICES)
    http_ports = {
        service: _port(settings, f"EXPERT_{service.upper()}_HTTP_PORT", port, minimum=0)
        for service, port in DEFAULT_HTTP_PORTS.items()
    }
    redis_url = settings.get("EXPERT_REDIS_URL") or None
    model = args.model or Path(settings.get("EXPERT_MODEL_PATH") or DEFAULT_MODEL_DIR)
    _check_before_start(args, model, redis_url)
    env = service_settings(settings, args.env, model)
    _check_ports_free(ports, metrics_ports, env["EXPERT_BIND_HOST"], http_ports)
    if args.trainer:  # the key it signs with: the one given, else a local one made once
        env["EXPERT_TRAINER_SIGNING_KEY"] = signing_key(args.log_dir, settings)

    stack = LocalStack(
        args.log_dir,
        env=env,
        ports=ports,
        metrics_ports=metrics_ports,
        http_ports=http_ports,
        redis_url=redis_url,
        redis_durable=True,
        redis_dir=args.redis_dir or args.log_dir.parent / "redis",
        redis_maxmemory=args.redis_maxmemory or DEFAULT_REDIS_MAXMEMORY,
        # With EXPERT_AUTH=required: the local CA's certificates, beside the Redis directory.
        tls_dir=args.log_dir.parent / "tls",
        trainer=args.trainer,
    )
    supervisor = Supervisor(stack, notice=lambda message: _notice(f"expertctl: {message}"))
    with _StopSignals() as signals:
        try:
            _notice(_starting(args, redis_url))
            stack.start(timeout=START_TIMEOUT_S)  # stops what it started if it fails or is stopped
            trainer = _shown(Path(env["EXPERT_TRAINER_SIGNING_KEY"])) if args.trainer else None
            print(_ready_block(stack, args.log_dir, metrics_ports, http_ports, model, auth, trainer))
            sys.stdout.flush()
            while True:  # until a stop signal
                with signals.held():  # a process started by a restart is always recorded to stop
                    supervisor.check()
                time.sleep(POLL_INTERVAL_S)
        except _StopRequested:
            _notice("stopping…")
            stack.stop()
            _notice("stopped")
            _notice(supervisor.summary())
            return 0
        except BaseException:
            signals.disarm()
            stack.stop()
            raise


def _ready_block(
    stack: LocalStack,
    log_dir: Path,
    metrics_ports: Mapping[str, int],
    http_ports: Mapping[str, int],
    model: Path,
    auth: str,
    trainer: str | None = None,
) -> str:
    """`how_to_call` for the stack just started."""
    return how_to_call(
        stack.target("reception"),
        stack.target("preparation"),
        metrics_ports,
        log_dir,
        http=stack.http_url() if http_ports["reception"] else None,
        model=model.resolve().name,
        expertctl=local_command("expertctl"),
        python=local_command("python"),
        auth=auth,
        buf=local_command("buf") if installed("buf") else None,
        trainer=trainer,
    )


def _starting(args: argparse.Namespace, redis_url: str | None) -> str:
    what = "the five services" + (" and the trainer" if args.trainer else "")
    return f"starting {what if redis_url else 'redis-server, ' + what}; logs in {args.log_dir}/"


def signing_key(log_dir: Path, settings: Mapping[str, str]) -> str:
    """The key the trainer signs with: EXPERT_TRAINER_SIGNING_KEY, else a local publisher key made
    once in keys/trainer beside the log directory, its public half put among the trusted keys the
    services read (EXPERT_TRUSTED_KEYS)."""
    from libs.experts.signing import SigningError
    from tools.local_keys import local_publisher_key

    if settings.get("EXPERT_TRAINER_SIGNING_KEY"):
        return settings["EXPERT_TRAINER_SIGNING_KEY"]
    trusted = Path(settings.get("EXPERT_TRUSTED_KEYS") or DEFAULT_TRUSTED_KEYS)
    try:
        return str(local_publisher_key(log_dir.parent / "keys" / "trainer", trusted).resolve())
    except (OSError, SigningError) as exc:
        raise UsageError(
            f"--trainer: cannot make the trainer's signing key ({exc}); set EXPERT_TRAINER_SIGNING_KEY"
        ) from None


def _shown(path: Path) -> str:
    """`path` as printed: relative when it lies below the current directory."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _check_before_start(args: argparse.Namespace, model: Path, redis_url: str | None) -> None:
    """The model is a checkpoint, the Redis flags fit, and a redis-server is there to start when no
    EXPERT_REDIS_URL names one."""
    from tools.stack import StackError

    if not (model / "config.json").is_file():
        raise UsageError(f"--model: {model} is not a checkpoint directory (`make model` makes the default)")
    _check_redis_flags(args, redis_url)
    if redis_url is None and shutil.which("redis-server") is None:
        raise StackError(
            "redis-server is not installed: `make run` installs it (apt-get install redis-server), "
            "or set EXPERT_REDIS_URL to a running Redis"
        )


def how_to_call(
    reception: str,
    preparation: str,
    metrics_ports: Mapping[str, int],
    log_dir: Path,
    http: str | None = None,
    model: str = "",
    expertctl: str = "expertctl",
    python: str = "python",
    auth: str = "off",
    buf: str | None = None,
    trainer: str | None = None,
) -> str:
    """The block printed once the stack is up: the CLI, the SDK, `buf curl` (None: not installed),
    the HTTP API (at `http`, serving `model`; None: off), whether API keys are required (`auth`:
    EXPERT_AUTH), the trainer (the key it signs with; None: not running), metrics and logs.
    `expertctl`, `python` and `buf` are how the user runs them from
    here (local_command). Every indented line is a command that works as printed."""
    # --target only when a service is not where the clients look by default.
    to_reception = "" if reception == "127.0.0.1:50051" else f"--target {reception} "
    to_preparation = "" if preparation == "127.0.0.1:50053" else f" --target {preparation}"
    client = "ExpertClient()" if not to_reception else f'ExpertClient("{reception}")'
    metrics = [
        f"http://127.0.0.1:{port}/metrics ({service})" for service, port in metrics_ports.items() if port
    ]
    lines = [
        f"{READY_LINE}: the API (reception) is at {reception}.",
        "",
        f'  {expertctl} infer {to_reception}"What is the capital of France?"',
        f'  {expertctl} stream {to_reception}"Tell me a story"',
        f"  {expertctl} engines{to_preparation}",
        "",
        "From Python (or any Python after `pip install ./sdk/python`):",
        f"  {python} -c 'from expert_system import ExpertClient; "
        f'print({client}.infer(prompt="What is the capital of France?").text)\'',
        "",
        *_buf_lines(buf, reception),
        *_http_lines(http, model),
        *_auth_lines(auth, expertctl, to_reception, to_preparation, log_dir.parent / "tls"),
        *_trainer_lines(trainer),
        "Metrics: " + (", ".join(metrics) if metrics else "off"),
        f"Logs:    {log_dir}/<service>.log",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def _auth_lines(
    auth: str, expertctl: str, to_reception: str, to_preparation: str, tls_dir: Path
) -> list[str]:
    if auth != "required":
        return ["Auth:    off (EXPERT_AUTH=required turns on API keys; see docs/api.md#authentication)"]
    return [
        "Auth:    required: make a key with the internal token, then send it (the CLI and the SDK read",
        "         EXPERT_API_KEY; HTTP clients send Authorization: Bearer <key>):",
        f"  EXPERT_INTERNAL_TOKEN=... {expertctl} keys create {to_reception}--name me",
        "  export EXPERT_API_KEY=<the key it printed>",
        f"         The other services talk mutual TLS (certificates in {tls_dir}/): `engines` and",
        "         `experts` need the client certificate (docs/operations.md#security); not exported, so",
        "         that a stack started from this shell makes its own:",
        f"  EXPERT_TLS_CA={tls_dir}/ca.pem EXPERT_TLS_CERT={tls_dir}/client.pem "
        f"EXPERT_TLS_KEY={tls_dir}/client.key EXPERT_INTERNAL_TOKEN=... {expertctl} engines{to_preparation}",
    ]


def _trainer_lines(signing_key: str | None) -> list[str]:
    if signing_key is None:
        return []
    return [
        "Trainer: running: training jobs (POST /v1/fine_tuning/jobs, `expertctl train submit`; see",
        "         docs/experts.md) end with an expert installed here, signed with",
        f"         {signing_key}.",
    ]


def _auth(settings: Mapping[str, str]) -> str:
    """EXPERT_AUTH as the services will read it: a required auth without its token fails here,
    before anything starts (the certificates it needs, LocalStack makes)."""
    from libs.auth.config import AuthConfig
    from libs.config import ConfigError

    try:
        return AuthConfig.from_env(settings, launcher_makes_tls=True).mode
    except ConfigError as error:
        raise UsageError(str(error)) from None


def _buf_lines(buf: str | None, reception: str) -> list[str]:
    """Raw gRPC calls with `buf curl` (the venv's dev tools install it; grpcurl has no package to
    install it from), over server reflection."""
    if buf is None:
        return []
    grpc = f"{buf} curl --protocol grpc --http2-prior-knowledge"
    return [
        "Raw gRPC with buf curl (server reflection is on):",
        f"  {grpc} --list-methods http://{reception}",
        f'  {grpc} -d \'{{"request": {{"prompt": "Hello", "max_tokens": 16}}}}\' '
        f"http://{reception}/expert.v1.InferenceService/Infer",
        "",
    ]


def _http_lines(http: str | None, model: str) -> list[str]:
    if http is None:
        return []
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    )
    return [
        f"With curl or any OpenAI client (the OpenAI API is at {http}/v1):",
        f"  curl -s {http}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        "",
    ]


def installed(name: str) -> bool:
    """Whether the program `name` is in this interpreter's environment or on PATH."""
    return (Path(os.path.abspath(sys.executable)).parent / name).is_file() or shutil.which(name) is not None


def local_command(name: str) -> str:
    """How to run the program `name` of this interpreter's environment (its bin directory) from
    the current directory, as printed for the user to copy: bare when that is what PATH finds
    (an activated venv), else its path, relative when it lies below here (.venv/bin/expertctl)."""
    program = Path(os.path.abspath(sys.executable)).parent / name
    if not program.is_file():
        return name
    found = shutil.which(name)
    if found is not None and os.path.samefile(found, program):
        return name
    try:
        return str(program.relative_to(Path.cwd()))
    except ValueError:
        return str(program)


def service_settings(settings: Mapping[str, str], flags: list[str], model: Path) -> dict[str, str]:
    """The settings LocalStack gives every service on top of the environment: the --env flags, the
    model, and where the user set none, the KV cache budget and the bind address (127.0.0.1)."""
    env = dict(_from_flags(flags))
    env["EXPERT_MODEL_PATH"] = str(model.resolve())
    if "EXPERT_KV_CACHE_BYTES" not in settings:
        env["EXPERT_KV_CACHE_BYTES"] = str(DEFAULT_KV_CACHE_BYTES)
    # Blank means unset to the services too (they would take their container default, 0.0.0.0).
    env["EXPERT_BIND_HOST"] = settings.get("EXPERT_BIND_HOST", "").strip() or LOCAL_BIND_HOST
    return env


def _check_redis_flags(args: argparse.Namespace, redis_url: str | None) -> None:
    given = [
        flag
        for flag, value in (("--redis-dir", args.redis_dir), ("--redis-maxmemory", args.redis_maxmemory))
        if value
    ]
    if redis_url is not None and given:
        raise UsageError(f"{given[0]}: only for the redis-server up starts, not with EXPERT_REDIS_URL")
    if args.redis_maxmemory is not None and not _MEMORY.match(args.redis_maxmemory):
        raise UsageError(
            f"--redis-maxmemory: expected a size such as 512mb or 2gb, got {args.redis_maxmemory!r}"
        )


def _from_flags(flags: list[str]) -> Iterator[tuple[str, str]]:
    for flag in flags:
        match = _SETTING.match(flag)
        if match is None:
            raise UsageError(f"--env: expected EXPERT_NAME=VALUE, got {flag!r}")
        yield match[1], match[2]


def _settings(environ: Mapping[str, str], flags: list[str]) -> dict[str, str]:
    """The EXPERT_* settings in effect: the environment's, overridden by --env."""
    settings = {key: value for key, value in environ.items() if key.startswith("EXPERT_")}
    settings.update(_from_flags(flags))
    return settings


def _ports(settings: Mapping[str, str], services: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """Each service's gRPC and metrics port: EXPERT_<SERVICE>_PORT / _METRICS_PORT, else the default.
    LocalStack sets these variables itself, so they are read here to reach it."""
    from tools.stack import DEFAULT_METRICS_PORTS, DEFAULT_PORTS, TRAINER, TRAINER_METRICS_PORT, TRAINER_PORT

    defaults = {**DEFAULT_PORTS, TRAINER: TRAINER_PORT}
    metrics_defaults = {**DEFAULT_METRICS_PORTS, TRAINER: TRAINER_METRICS_PORT}
    ports, metrics_ports = {}, {}
    for service in services:
        name = f"EXPERT_{service.upper()}"
        # 0 (pick any port) cannot be used for gRPC: the stack must know where to find the service.
        ports[service] = _port(settings, f"{name}_PORT", defaults[service], minimum=1)
        metrics_ports[service] = _port(settings, f"{name}_METRICS_PORT", metrics_defaults[service], minimum=0)
    return ports, metrics_ports


def _port(settings: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = settings.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not minimum <= int(raw) <= 65535:
        raise UsageError(f"{name}: expected a port in [{minimum}, 65535], got {raw!r}")
    return int(raw)


def _check_ports_free(
    ports: Mapping[str, int],
    metrics_ports: Mapping[str, int],
    host: str,
    http_ports: Mapping[str, int] | None = None,
) -> None:
    """Fail before starting anything when a port is taken on `host`, where the services will listen
    (most often: a stack is already running). A listener on every address (0.0.0.0) takes the port
    on 127.0.0.1 too, and binding here fails on it."""
    wanted = {f"EXPERT_{s.upper()}_PORT": p for s, p in ports.items()}
    wanted |= {f"EXPERT_{s.upper()}_METRICS_PORT": p for s, p in metrics_ports.items() if p}
    wanted |= {f"EXPERT_{s.upper()}_HTTP_PORT": p for s, p in (http_ports or {}).items() if p}
    for variable, port in wanted.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror:
            raise UsageError(f"EXPERT_BIND_HOST: cannot resolve {host!r}") from None
        with socket.socket(family, kind, proto) as sock:
            # SO_REUSEADDR: a port whose last connections linger in TIME_WAIT is free to listen on.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError:
                raise UsageError(
                    f"port {port} ({variable}) is in use: is a stack already running? "
                    f"(--env {variable}=N moves it)"
                ) from None


class _StopSignals:
    """While entered, the first SIGINT or SIGTERM raises _StopRequested in the main thread (at the
    end of a `held` block if it comes within one). After that, or once disarmed (a stop is under
    way for another reason), signals only say that the stop is in progress: a second Ctrl-C must
    not interrupt the stop and leave processes behind."""

    def __init__(self) -> None:
        self._armed = True
        self._holding = False
        self._held = False
        self._previous: dict[int, object] = {}

    def disarm(self) -> None:
        self._armed = False

    @contextmanager
    def held(self) -> Iterator[None]:
        """Within, a stop signal waits until the block ends: starting a process is not cut between
        the start and the record the stop reads."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._held:
            self._held = False
            raise _StopRequested

    def _handle(self, signum: int, frame: object) -> None:
        if not self._armed:
            _notice("stopping, please wait…")
            return
        self._armed = False
        if self._holding:
            self._held = True
            return
        raise _StopRequested

    def __enter__(self) -> _StopSignals:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _error(message: str) -> None:
    print(f"expertctl: error: {message}", file=sys.stderr, flush=True)
