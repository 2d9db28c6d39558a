"""tools.child_process: a child the stack starts never outlives the process that started it,
whatever kills that one, though it runs in a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.grpc_services import REPO

# A launcher: starts `sleep` through spawn() from its main thread, and from a worker thread that
# then ends, prints both pids, and waits to be killed.
LAUNCHER = """
import sys, threading, time
from pathlib import Path
from tools.child_process import spawn

log = Path(sys.argv[1])
tied = spawn(["sleep", "600"], log)
untied = []
worker = threading.Thread(target=lambda: untied.append(spawn(["sleep", "600"], log)))
worker.start()
worker.join()
print(tied.pid, untied[0].pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_the_launcher_killed_by_sigkill(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "child.log")],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    tied, untied = (int(pid) for pid in launcher.stdout.readline().split())
    try:
        assert os.getsid(tied) == tied  # a session of its own: no terminal signal reaches it
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while _running(tied) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(tied), "the child outlived its launcher"
        # One started from a thread that has ended is not tied: the kernel would have ended it
        # with that thread, long before its launcher.
        assert _running(untied)
    finally:
        for pid in (tied, untied):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.stdout.close()


def test_starting_children_leaves_a_busy_grpc_channel_alone(tmp_path):
    """`expertctl up` and the tests start services while their gRPC channels poll others. No code
    of ours runs between fork and exec, so gRPC's fork handlers never run: with them, grpcio closed
    the launcher's open streams and now and then aborted the child before it ran its program."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tools.child_process import spawn

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    done, errors, calls = threading.Event(), [], []

    def poll() -> None:
        while not done.is_set():
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                calls.append(1)
            except grpc.RpcError as exc:
                errors.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        exits = [spawn(["true"], tmp_path / "child.log").wait(timeout=30) for _ in range(100)]
    finally:
        done.set()
        poller.join(timeout=30)
        channel.close()
        server.stop(None)
    assert exits == [0] * 100
    assert not errors, errors[0]
    assert calls
