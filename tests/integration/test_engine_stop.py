"""The engine service stops at once on SIGTERM while its model is still being built: a build
(loading the weights, compiling the kernels: minutes) is not waited for."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from libs.engine.kernels.build import build_dir, load
from tests.helpers.grpc_services import REPO
from tests.helpers.ports import free_port


def test_sigterm_while_the_engine_builds_stops_it_at_once(tiny_llama, tmp_path):
    if not load():
        pytest.skip("the kernels cannot be built here")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "EXPERT_MODEL_PATH": str(tiny_llama),
        "EXPERT_BIND_HOST": "127.0.0.1",
        "EXPERT_ENGINE_PORT": str(free_port()),
        "EXPERT_ENGINE_METRICS_PORT": "0",
        "EXPERT_MAX_MODEL_LEN": "256",
        "EXPERT_KV_NUM_BLOCKS": "32",
        "EXPERT_PREPARATION_TARGET": f"127.0.0.1:{free_port()}",  # nobody: never reached
    }
    # Another process building the kernels holds this lock: the engine's build waits on it.
    with open(build_dir() / "builders.lock", "a") as builder:
        fcntl.flock(builder, fcntl.LOCK_EX)
        process = subprocess.Popen(
            [sys.executable, "-m", "services.engine"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            for line in process.stdout:
                if '"server started"' in line:
                    break
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert process.wait(timeout=30) == 0
            assert time.monotonic() - started < 5.0  # not its grace period: nothing was running
            assert '"server stopped"' in process.stdout.read()
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
            process.stdout.close()
