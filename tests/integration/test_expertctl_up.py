"""`expertctl up` as `make run` starts it: a real process that runs redis-server (durable, capped)
and the five services on the tiny model (and, as `make run` runs it, the trainer with the local key
it makes), all on 127.0.0.1, answers a real job, restarts a service that is killed, and on Ctrl-C
stops everything and exits 0. Every port is moved to a free one, so
this runs next to another stack; logs and Redis's append-only file go to the test's directory."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from stat import S_IMODE

import pytest
import redis
from grpc_health.v1 import health_pb2

from expert_system import ExpertClient
from libs.gen.expert.v1 import common_pb2
from services.reception.jobs import job_key
from tests.conftest import LONG
from tools.expertctl.errors import UsageError
from tools.expertctl.up_cmd import READY_LINE, _check_ports_free, _settings, service_settings
from tools.stack import SERVICES, TRAINER, free_port, health_status
from tools.supervisor import Backoff

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 45.0
# What the end-to-end stacks on the tiny model use (tests/e2e/conftest.py).
TINY_SETTINGS = {
    "EXPERT_NUM_THREADS": "2",
    "EXPERT_MAX_MODEL_LEN": "2048",
    "EXPERT_KV_NUM_BLOCKS": "160",
    "EXPERT_MAX_NUM_SEQS": "4",
    "EXPERT_PREPARATION_HEARTBEAT_SECONDS": "0.5",
}


def _environment() -> dict[str, str]:
    """This process's environment without EXPERT_* settings (a Redis URL or a model path set in the
    developer's shell must not leak in), except where the kernels are cached."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EXPERT_") or k == "EXPERT_KERNELS_DIR"}


def _flags(settings: dict[str, str]) -> list[str]:
    return [arg for name, value in settings.items() for arg in ("--env", f"{name}={value}")]


def _expertctl_up(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.expertctl.main", "up", *args]


class _Lines:
    """The lines of a process's output, read by a thread so that waiting can time out."""

    def __init__(self, stream) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                return False
            self.seen.append(line)
            if text in line:
                return True
        return False

    def rest(self) -> str:
        while True:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return "".join(self.seen)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _child(pid: int, program: str) -> int:
    """The one child of `pid` whose command line has `program` (e.g. "services.engine")."""
    found = [c for c in _children(pid) if program in _command_line(c)]
    assert len(found) == 1, (program, found)
    return found[0]


def _command_line(pid: int) -> str:
    """The command line, or the title a process gave itself (redis-server: "redis-server
    127.0.0.1:PORT")."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _listening_on(port: int) -> set[str]:
    """The addresses that TCP sockets listen on at `port`, from /proc/net/tcp and tcp6 (where
    0.0.0.0 or :: would mean every interface)."""
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            host, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)  # 32-bit words in the kernel's (little-endian) order
            address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            # gRPC may listen on 127.0.0.1 with an IPv6 socket, as ::ffff:127.0.0.1
            addresses.add(str(getattr(address, "ipv4_mapped", None) or address))
    return addresses


def _up_settings(
    tmp_path: Path, services: tuple[str, ...] = SERVICES
) -> tuple[dict[str, int], dict[str, str]]:
    """Free gRPC ports for the five services (and the trainer, when `services` names it) and
    reception's HTTP, metrics off, the tiny model's settings, and the router's data (its embedded
    Qdrant) in the test's directory rather than the repository's; with the trainer, the trusted
    keys (where up puts its key's public half) and its checkpoints too."""
    ports = {service: free_port() for service in services}
    settings = {**TINY_SETTINGS, "EXPERT_DATA_DIR": str(tmp_path / "data")}
    if TRAINER in services:
        settings["EXPERT_TRUSTED_KEYS"] = str(tmp_path / "trusted")
        settings["EXPERT_TRAINER_CHECKPOINT_DIR"] = str(tmp_path / "training")
    settings["EXPERT_RECEPTION_HTTP_PORT"] = str(free_port())
    for service, port in ports.items():
        settings[f"EXPERT_{service.upper()}_PORT"] = str(port)
        settings[f"EXPERT_{service.upper()}_METRICS_PORT"] = "0"
    return ports, settings


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def up(tiny_llama, tmp_path) -> Iterator:
    """A factory that starts `expertctl up` in its own process group (like a shell job, so the
    SIGINT below reaches it and its redis-server as a terminal's Ctrl-C does); kills what is left."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        process = subprocess.Popen(
            _expertctl_up(*args),
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            services = _children(process.pid)  # in sessions of their own: not in the group
            os.killpg(process.pid, signal.SIGKILL)
            for pid in services:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()


def _start_up(up, model: Path, log_dir: Path, settings: dict[str, str], *flags: str):
    """`expertctl up` on `model` with `settings` (and `flags`), once it printed its ready line: the
    process and readers of its stdout and stderr."""
    process = up("--model", str(model), "--log-dir", str(log_dir), *_flags(settings), *flags)
    stdout, stderr = _Lines(process.stdout), _Lines(process.stderr)
    if not stdout.wait_for(READY_LINE, START_TIMEOUT_S):
        process.kill()
        pytest.fail(f"no ready line; stdout:\n{stdout.rest()}\nstderr:\n{stderr.rest()}")
    return process, stdout, stderr


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_serves_a_job_and_ctrl_c_stops_everything(up, tiny_llama, tmp_path):
    """As `make run` runs it: with the trainer, which signs with a local key up makes and trusts."""
    ports, settings = _up_settings(tmp_path, (*SERVICES, TRAINER))
    metrics_port = free_port()
    settings["EXPERT_RECEPTION_METRICS_PORT"] = str(metrics_port)
    log_dir = tmp_path / "logs"
    process, stdout, stderr = _start_up(up, tiny_llama, log_dir, settings, "--trainer")
    reception = f"127.0.0.1:{ports['reception']}"
    assert f"{READY_LINE}: the API (reception) is at {reception}." in "".join(stdout.seen)
    for service in (*SERVICES, TRAINER):
        assert (log_dir / f"{service}.log").stat().st_size > 0, service  # JSON logs, one file each
    assert (log_dir / "redis.log").is_file()

    with ExpertClient(reception) as client:
        result = client.infer(prompt="Hello", max_tokens=8, temperature=0.0, timeout=60)
    assert result.status == "completed", result
    assert 0 < result.tokens_generated <= 8
    # Its audit line goes to the log directory, not into reception's log (docs/operations.md#audit-log).
    assert _wait_for_line(log_dir / "audit.log", result.job_id)
    assert '"key_id"' not in (log_dir / "reception.log").read_text()

    # The banner's commands work exactly as printed, from where `up` was started.
    assert stdout.wait_for("Ctrl-C stops everything", 10)
    assert "Auth:    off (EXPERT_AUTH=required turns on API keys" in "".join(stdout.seen)
    # The trainer's key: made beside the log directory, owner-only, its public half trusted, given
    # to the trainer and named by the banner.
    key = (tmp_path / "keys" / "trainer" / "signing.key").resolve()
    assert S_IMODE(key.stat().st_mode) == 0o600 and f"{key}." in "".join(stdout.seen)
    trusted = [p.read_bytes() for p in (tmp_path / "trusted").iterdir()]
    assert trusted == [key.with_name("signing.pub").read_bytes()]
    trainer = _child(process.pid, "services.trainer")
    assert f"EXPERT_TRAINER_SIGNING_KEY={key}\0" in Path(f"/proc/{trainer}/environ").read_text()
    # Every indented line is a command: each one, exactly as printed, answers.
    commands = [line.strip() for line in stdout.seen if line.startswith("  ") and not line[2].isspace()]
    assert len(commands) == 7, stdout.seen  # infer, stream, engines, python, 2 x buf curl, curl
    answers = {}
    for command in commands:
        done = subprocess.run(
            command, shell=True, env=_environment(), capture_output=True, text=True, timeout=120
        )
        # An answer: text, or (expertctl's streams, whose tiny-model text may end at once) the
        # job's summary line on stderr.
        answered = done.stdout.strip() or done.stderr.startswith("job ")
        assert done.returncode == 0 and answered, (command, done.stdout, done.stderr)
        answers[command] = done.stdout
    http_port = int(settings["EXPERT_RECEPTION_HTTP_PORT"])
    assert f"http://127.0.0.1:{http_port}/v1/chat/completions" in commands[-1], commands
    assert json.loads(answers[commands[-1]])["object"] == "chat.completion"  # the curl line's answer
    listed = next(c for c in commands if "--list-methods" in c)
    assert "expert.v1.InferenceService/Infer" in answers[listed]
    inferred = next(c for c in commands if c.endswith("/expert.v1.InferenceService/Infer"))
    assert json.loads(answers[inferred])["result"]["status"] == "JOB_STATUS_COMPLETED"

    # Every listener is on 127.0.0.1 only: the services' gRPC and metrics ports, and Redis's.
    redis_port = int(_command_line(_child(process.pid, "redis-server")).split(":")[-1])
    for port in [*ports.values(), metrics_port, http_port, redis_port]:
        assert _listening_on(port) == {"127.0.0.1"}, port
    # Redis keeps an append-only file beside the logs, and may only evict keys that expire.
    # It asks for the password kept beside its append-only file, for the owner only.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=redis_port).ping()
    password = _redis_password(tmp_path / "redis")
    with redis.Redis(port=redis_port, password=password, decode_responses=True) as client:
        config = client.config_get("*")
    assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")
    assert (config["maxmemory"], config["maxmemory-policy"]) == (str(512 << 20), "volatile-ttl")
    assert Path(config["dir"]) == tmp_path / "redis"
    assert (tmp_path / "redis" / "appendonlydir").is_dir()

    children = _children(process.pid)  # redis-server, the five services and the trainer
    assert len(children) == len(SERVICES) + 2, children
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.rest()
    notices = stderr.rest()
    assert "stopping" in notices and "stopped" in notices
    assert "restarts: none" in notices
    assert [pid for pid in children if _running(pid)] == []
    for service, port in ports.items():
        assert health_status(f"127.0.0.1:{port}", timeout=0.5) is None, f"{service} still answers"
    # The services stopped before Redis, and none logged an error on the way out.
    for service in (*SERVICES, TRAINER):
        lines = (log_dir / f"{service}.log").read_text().splitlines()
        errors = [line for line in lines if '"level": "error"' in line or "Traceback" in line]
        assert errors == [], f"{service}: {errors[:3]}"
    assert "Received SIGTERM scheduling shutdown" in (log_dir / "redis.log").read_text()


@pytest.mark.timeout(240)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_with_required_auth_makes_a_local_ca_and_serves_over_mutual_tls(up, tiny_llama, tmp_path):
    token = "up-mtls-internal-token-0123456789abcdef"
    ports, settings = _up_settings(tmp_path)
    settings |= {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": token}
    process, stdout, stderr = _start_up(up, tiny_llama, tmp_path / "logs", settings)
    assert stdout.wait_for("Ctrl-C stops everything", 10)
    tls = tmp_path / "tls"  # beside the logs and the Redis directory, the owner's only
    assert S_IMODE(tls.stat().st_mode) == 0o700
    assert all(S_IMODE(path.stat().st_mode) == 0o600 for path in tls.iterdir())
    prefix = f"EXPERT_TLS_CA={tls}/ca.pem EXPERT_TLS_CERT={tls}/client.pem EXPERT_TLS_KEY={tls}/client.key"
    (printed,) = [line.strip() for line in stdout.seen if line.strip().startswith(prefix)]
    for service in SERVICES:
        expected = '"tls": false' if service == "reception" else '"tls": true'
        assert expected in (tmp_path / "logs" / f"{service}.log").read_text(), service

    env = {**_environment(), "EXPERT_INTERNAL_TOKEN": token}
    reception, preparation = (f"127.0.0.1:{ports[s]}" for s in ("reception", "preparation"))
    expertctl = [sys.executable, "-m", "tools.expertctl.main"]
    made = subprocess.run(
        [*expertctl, "keys", "create", "--target", reception, "--name", "me"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    with ExpertClient(reception, api_key=made.stdout.strip().splitlines()[-1]) as client:
        assert client.infer(prompt="Hello", max_tokens=4, temperature=0.0, timeout=60).status == "completed"
    # An internal port: refused without the client certificate, answered with it.
    engines = [*expertctl, "engines", "--target", preparation]
    refused = subprocess.run(engines, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused.stdout
    certified = {
        **env,
        "EXPERT_TLS_CA": str(tls / "ca.pem"),
        "EXPERT_TLS_CERT": str(tls / "client.pem"),
        "EXPERT_TLS_KEY": str(tls / "client.key"),
    }
    listed = subprocess.run(engines, env=certified, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and listed.stdout.strip(), listed.stderr
    # The banner's line works as printed (the token where it shows `...`).
    as_printed = subprocess.run(
        printed.replace("EXPERT_INTERNAL_TOKEN=...", f"EXPERT_INTERNAL_TOKEN={token}"),
        shell=True,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert as_printed.returncode == 0 and as_printed.stdout.strip(), (printed, as_printed.stderr)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.rest()


def _redis_password(directory: Path) -> str:
    return (directory / "password").read_text().strip()


def _wait_for_line(path: Path, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_restarts_a_killed_engine_and_a_killed_redis(up, tiny_llama, long_prompt, tmp_path):
    """SIGKILL the engine with 10 jobs in flight, and submit 10 more: up says so and restarts it
    after 1 s (not the whole stack), and every job completes on the new engine. SIGKILL Redis: the
    same, and the new redis-server has the jobs' records (from the append-only file). Ctrl-C still
    stops everything, exits 0 and counts the restarts."""
    ports, settings = _up_settings(tmp_path)
    log_dir = tmp_path / "logs"
    process, _, stderr = _start_up(up, tiny_llama, log_dir, settings)
    engine = f"127.0.0.1:{ports['engine']}"
    others = {name: _child(process.pid, f"services.{name}") for name in SERVICES if name != "engine"}
    killed = _child(process.pid, "services.engine")
    options = {"raw": True, "temperature": 0.0, "repetition_penalty": 1.0, "timeout_ms": 240_000}

    with ExpertClient(f"127.0.0.1:{ports['reception']}") as client:
        jobs = [client.submit(prompt=long_prompt, max_tokens=LONG, **options).job_id for _ in range(10)]
        assert _wait_until(lambda: client.get_job(jobs[0]).status == "running", 60)
        os.kill(killed, signal.SIGKILL)
        jobs += [client.submit(prompt=long_prompt, max_tokens=64, **options).job_id for _ in range(10)]
        restart = f"expertctl: engine exited with status -9; restart 1 in 1 s (log: {log_dir / 'engine.log'})"
        assert stderr.wait_for(restart, 15), stderr.rest()
        assert _wait_until(lambda: health_status(engine) == health_pb2.HealthCheckResponse.SERVING, 60)
        assert stderr.wait_for("expertctl: engine is ready again", 15), stderr.rest()
        assert _child(process.pid, "services.engine") != killed
        assert _wait_until(lambda: all(client.get_job(job).is_finished for job in jobs), 180)
        finals = [client.get_job(job) for job in jobs]
    assert [job.status for job in finals] == ["completed"] * 20, [(j.status, j.result.error) for j in finals]
    result = finals[-1].result
    assert process.poll() is None  # the stack stayed up
    assert {name: _child(process.pid, f"services.{name}") for name in others} == others  # untouched

    redis_server = _child(process.pid, "redis-server")
    redis_port = int(_command_line(redis_server).split(":")[-1])
    with redis.Redis(port=redis_port, password=_redis_password(tmp_path / "redis")) as client:
        # the job's record is in the append-only file (written; fsync'd within a second)
        assert _wait_until(lambda: client.info("persistence")["aof_buffer_length"] == 0, 5)
        os.kill(redis_server, signal.SIGKILL)
        restart = f"expertctl: redis exited with status -9; restart 1 in 1 s (log: {log_dir / 'redis.log'})"
        assert stderr.wait_for(restart, 15), stderr.rest()
        assert stderr.wait_for("expertctl: redis is ready again", 15), stderr.rest()
        assert client.hget(job_key(result.job_id), "status") == str(common_pb2.JOB_STATUS_COMPLETED).encode()

    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.rest()
    notices = stderr.rest()
    assert "stopped" in notices and "restarts: engine 1, redis 1" in notices, notices
    assert notices.count("exited with status") == 2, notices  # nothing else was restarted


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_killed_with_sigkill_takes_its_services_and_redis_with_it(up, tiny_llama, tmp_path):
    """Nothing outlives `up`, whatever kills it: its children stop (they are sent SIGTERM by the
    kernel, tools.child_process) and every port is free for the next start."""
    ports, settings = _up_settings(tmp_path)
    process, _, _ = _start_up(up, tiny_llama, tmp_path / "logs", settings)
    children = _children(process.pid)
    assert len(children) == len(SERVICES) + 1, children  # redis-server and the five services

    process.kill()  # SIGKILL: no handler runs, nothing is stopped by `up` itself
    process.wait()
    killed = time.monotonic()
    assert _wait_until(lambda: not any(_running(pid) for pid in children), 30), [
        _command_line(pid) for pid in children if _running(pid)
    ]
    print(f"all children gone {time.monotonic() - killed:.1f} s after the SIGKILL")
    http = {"reception": int(settings["EXPERT_RECEPTION_HTTP_PORT"])}
    _check_ports_free(ports, {}, "127.0.0.1", http)  # what the next `up` checks first
    for service, port in ports.items():
        assert health_status(f"127.0.0.1:{port}", timeout=0.5) is None, f"{service} still answers"


def test_a_restart_waits_twice_as_long_after_each_quick_exit_and_1_s_after_a_long_run():
    backoff = Backoff()
    assert [backoff.delay(uptime_s=2.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.delay(uptime_s=60.0) == 1  # it had stayed up: the backoff starts over
    assert backoff.delay(uptime_s=0.5) == 2


def test_up_listens_on_127_0_0_1_unless_the_user_sets_a_bind_host(tiny_llama):
    def bind_host(environ: dict[str, str], flags: tuple[str, ...] = ()) -> str:
        settings = _settings(environ, list(flags))  # as `up` reads them
        return service_settings(settings, list(flags), tiny_llama)["EXPERT_BIND_HOST"]

    assert bind_host({}) == "127.0.0.1"
    assert bind_host({"EXPERT_BIND_HOST": " "}) == "127.0.0.1"  # blank is unset
    assert bind_host({"EXPERT_BIND_HOST": "0.0.0.0"}) == "0.0.0.0"
    assert bind_host({"EXPERT_BIND_HOST": "0.0.0.0"}, ("EXPERT_BIND_HOST=::",)) == "::"


def test_up_refuses_a_model_directory_that_is_not_a_checkpoint(tmp_path):
    result = subprocess.run(
        _expertctl_up("--model", str(tmp_path / "missing"), "--log-dir", str(tmp_path / "logs")),
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"expertctl: error: --model: {tmp_path / 'missing'} is not a checkpoint directory "
        "(`make model` makes the default)"
    )
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_up_refuses_required_auth_without_the_internal_token(tiny_llama, tmp_path):
    result = subprocess.run(
        _expertctl_up("--model", str(tiny_llama), "--log-dir", str(tmp_path / "logs")),
        env={**_environment(), "EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("expertctl: error: EXPERT_INTERNAL_TOKEN: required with EXPERT_AUTH=required")
    )
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_up_reports_a_busy_port_before_starting_anything(tiny_llama, tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        others = [f"EXPERT_{s.upper()}_PORT={free_port()}" for s in SERVICES if s != "router"]
        result = subprocess.run(
            _expertctl_up(
                "--model",
                str(tiny_llama),
                "--log-dir",
                str(tmp_path / "logs"),
                "--env",
                f"EXPERT_ROUTER_PORT={port}",
                *(arg for setting in others for arg in ("--env", setting)),
                *(arg for s in SERVICES for arg in ("--env", f"EXPERT_{s.upper()}_METRICS_PORT=0")),
            ),
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"expertctl: error: port {port} (EXPERT_ROUTER_PORT) is in use"), message
    assert not (tmp_path / "logs").exists()


def test_up_checks_that_the_http_port_is_free_too():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {service: free_port() for service in SERVICES}
        with pytest.raises(UsageError, match=rf"port {port} \(EXPERT_RECEPTION_HTTP_PORT\) is in use"):
            _check_ports_free(ports, {}, "127.0.0.1", {"reception": port})
