"""Starting the stack's processes so that they never outlive the process that started them.

Each child runs in a session of its own (a terminal's Ctrl-C reaches only the launcher, which stops
the services first and Redis last), so nothing of the terminal's would end it. Instead the kernel
does: each child asks, before it runs its program, to be sent SIGTERM when its parent dies
(Linux's PR_SET_PDEATHSIG), whatever kills the parent, SIGKILL included. SIGTERM, not SIGKILL: a
service stops gracefully (reception hands its jobs back), Redis writes its append-only file; each
service bounds its own stop (libs.grpc_server), so none lingers.

The kernel sends the signal when the *thread* that started the child ends, so only children started
from the main thread are tied; one started from a worker thread (a test restarting Redis on a pool)
would otherwise die with that thread. Elsewhere than Linux nothing is tied.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # resolved here, not after fork


def spawn(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    stdin_text: str | None = None,
    umask: int = -1,
) -> subprocess.Popen:
    """Start `argv` in a new session, its output appended to `log_path`, tied to this process
    (from the main thread, on Linux). `stdin_text` is written to its standard input, which is then
    closed (a secret that must not appear on its command line); without it, stdin is /dev/null.
    `umask` (-1: this process's) applies to the files it creates."""
    with open(log_path, "ab") as log:  # the process has its own copy
        process = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_tie_to_parent(),
            umask=umask,
        )
    if stdin_text is not None:
        with process.stdin:
            process.stdin.write(stdin_text.encode())
    return process


def _tie_to_parent() -> Callable[[], None] | None:
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def tie() -> None:  # runs in the child, between fork and exec
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the tie took hold: nobody would signal
            os._exit(1)

    return tie
