"""`expertctl up` as `make run` starts it: a real process that runs redis-server and the five
services on the tiny model, answers a real job, and on Ctrl-C stops everything and exits 0. Every
port is moved to a free one, so this runs next to another stack; logs go to the test's directory."""

from __future__ import annotations

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

import pytest

from expert_system import ExpertClient
from libs.expertctl.up_cmd import READY_LINE
from libs.stack import SERVICES, free_port, health_status

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
    return [sys.executable, "-m", "libs.expertctl.main", "up", *args]


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
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_serves_a_job_and_ctrl_c_stops_everything(up, tiny_llama, tmp_path):
    ports = {service: free_port() for service in SERVICES}
    settings = dict(TINY_SETTINGS)
    for service, port in ports.items():
        settings[f"EXPERT_{service.upper()}_PORT"] = str(port)
        settings[f"EXPERT_{service.upper()}_METRICS_PORT"] = "0"
    log_dir = tmp_path / "logs"
    process = up("--model", str(tiny_llama), "--log-dir", str(log_dir), *_flags(settings))
    stdout, stderr = _Lines(process.stdout), _Lines(process.stderr)

    if not stdout.wait_for(READY_LINE, START_TIMEOUT_S):
        process.kill()
        pytest.fail(f"no ready line; stdout:\n{stdout.rest()}\nstderr:\n{stderr.rest()}")
    reception = f"localhost:{ports['reception']}"
    assert f"{READY_LINE}: the API (reception) is at {reception}." in "".join(stdout.seen)
    for service in SERVICES:
        assert (log_dir / f"{service}.log").stat().st_size > 0, service  # JSON logs, one file each
    assert (log_dir / "redis.log").is_file()

    with ExpertClient(reception) as client:
        result = client.infer(prompt="Hello", max_tokens=8, temperature=0.0, timeout=60)
    assert result.status == "completed", result
    assert 0 < result.tokens_generated <= 8

    children = _children(process.pid)  # redis-server and the five services
    assert len(children) == len(SERVICES) + 1, children
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.rest()
    notices = stderr.rest()
    assert "stopping" in notices and "stopped" in notices
    assert [pid for pid in children if _running(pid)] == []
    for service, port in ports.items():
        assert health_status(f"localhost:{port}", timeout=0.5) is None, f"{service} still answers"


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
