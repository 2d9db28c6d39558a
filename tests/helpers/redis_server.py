"""A real, throwaway redis-server for tests: a free localhost port, a temporary directory, no
persistence; stopped when the context exits."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import redis

from tests.helpers.ports import free_port

STARTUP_TIMEOUT_S = 10.0


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Starts `redis-server` and yields its URL (redis://127.0.0.1:<port>/0) once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed (apt-get install redis-server): the Redis tests need it"
        )
    with tempfile.TemporaryDirectory(prefix="redis-test-") as directory:
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            _wait_for_ping(url, process)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


def _wait_for_ping(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        while True:
            if process.poll() is not None:
                output = process.stdout.read().decode(errors="replace") if process.stdout else ""
                raise RuntimeError(f"redis-server exited with {process.returncode}: {output.strip()}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server at {url} did not answer PING within {STARTUP_TIMEOUT_S:g} s"
                )
            time.sleep(0.02)
    finally:
        client.close()


def flush(url: str) -> None:
    """Deletes every key of the server at `url`, so a test starts from an empty database."""
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()
