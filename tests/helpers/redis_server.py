"""A real, throwaway redis-server for tests: a free localhost port, a temporary directory, no
persistence (or, for the outage tests, an append-only file and a server that can be killed and
started again); stopped when the context exits."""

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
    with tempfile.TemporaryDirectory(prefix="redis-test-") as directory:
        server = RedisServer(directory, durable=False)
        try:
            server.start()
            yield server.url
        finally:
            server.stop()


@contextlib.contextmanager
def durable_redis_server() -> Iterator[RedisServer]:
    """A redis-server with its append-only file (fsync at every write), which a test may kill and
    start again on the same port: it comes back with everything it was told."""
    with tempfile.TemporaryDirectory(prefix="redis-test-") as directory:
        server = RedisServer(directory, durable=True)
        try:
            server.start()
            yield server
        finally:
            server.stop()


class RedisServer:
    """One redis-server on a port of its own, in `directory`."""

    def __init__(self, directory: str, durable: bool) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (apt-get install redis-server): the Redis tests need it"
            )
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", directory]
        self.args += ["--save", "", "--daemonize", "no", "--loglevel", "warning"]
        self.args += ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it (again) and wait until it answers PING."""
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        _wait_for_ping(self.url, self.process)

    def kill(self) -> None:
        """SIGKILL, as a crash: a durable server has its append-only file up to the last write."""
        if self.process is not None:
            self.process.kill()
            self._reap()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self._reap()

    def _reap(self) -> None:
        if self.process is not None:
            self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None


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
