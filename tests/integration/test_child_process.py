"""tools.child_process: a child the stack starts never outlives the process that started it,
whatever kills that one, though it runs in a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
