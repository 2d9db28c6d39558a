"""Starting the stack's processes so that they never outlive the process that started them.

Each child runs in a session of its own (a terminal's Ctrl-C reaches only the launcher, which stops
the services first and Redis last), so nothing of the terminal's would end it. Instead the kernel
does: each child asks, before it runs its program, to be sent SIGTERM when its parent dies
(Linux's PR_SET_PDEATHSIG), whatever kills the parent, SIGKILL included. SIGTERM, not SIGKILL: a
service stops gracefully (reception hands its jobs back), Redis writes its append-only file; each
service bounds its own stop (libs.grpc_server), so none lingers.

The child asks through util-linux's `setpriv --pdeathsig TERM`, which then executes the program in
its place, not through Python code run between fork and exec (`preexec_fn`): with no such code
Python starts the child with vfork, and gRPC's fork handlers never run. They did with
`preexec_fn`, in a launcher whose gRPC channels were busy (`expertctl up` and the tests poll the
services): grpcio 1.8x closed the launcher's open streams ("Stream removed") and now and then
aborted the child before its program ran ("epoll_wait error: Bad file descriptor", a service
exiting with -6; grpc/grpc#43055).

The kernel sends the signal when the *thread* that started the child ends, so only children started
from the main thread are tied; one started from a worker thread (a test restarting Redis on a pool)
would otherwise die with that thread. Elsewhere than Linux, or without `setpriv`, nothing is tied.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


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
            _tied_to_parent(argv),
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=umask,
        )
    if stdin_text is not None:
        with process.stdin:
            process.stdin.write(stdin_text.encode())
    return process


def _tied_to_parent(argv: Sequence[str]) -> list[str]:
    """`argv`, run through setpriv so that it gets SIGTERM when this thread's process dies; as it
    is from a worker thread, or where there is no setpriv."""
    if _SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]
