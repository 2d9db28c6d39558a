"""Keeps a LocalStack's processes running, as compose's `restart: unless-stopped` does.

A process that exits (a service, an extra engine, the stack's redis-server) is started again after
a backoff: 1 s, then 2 s, 4 s … up to 30 s for each further exit, back to 1 s once it has stayed
up 60 s. `Supervisor.check` looks once and does not wait; `expertctl up` calls it every half
second, and stops the stack itself on Ctrl-C.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.stack import LocalStack

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # up this long, a process that exits is restarted after BACKOFF_FIRST_S again


@dataclass
class Backoff:
    """The delays before the restarts of one process."""

    first_s: float = BACKOFF_FIRST_S
    max_s: float = BACKOFF_MAX_S
    stable_after_s: float = STABLE_AFTER_S
    quick_exits: int = 0  # exits since the process last stayed up stable_after_s

    def delay(self, uptime_s: float) -> float:
        """The delay before restarting the process, which exited after `uptime_s` seconds up."""
        if uptime_s >= self.stable_after_s:
            self.quick_exits = 0
        delay = min(self.first_s * 2 ** min(self.quick_exits, 32), self.max_s)
        self.quick_exits += 1
        return delay


@dataclass
class _Watched:
    started_at: float
    backoff: Backoff = field(default_factory=Backoff)
    restart_at: float | None = None  # while it is down: when it starts again
    restarted: bool = False  # started again and not yet seen ready


class Supervisor:
    """Restarts the stack's processes that exit; `restarts` counts the restarts of each."""

    def __init__(
        self,
        stack: LocalStack,
        notice: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.notice = notice
        self.clock = clock
        self.restarts: Counter[str] = Counter()
        self._watched: dict[str, _Watched] = {}

    def check(self) -> None:
        """One look at every process: schedule the restart of one that exited, start those whose
        backoff has passed, say when a restarted one is ready again. Never waits for a process to
        start or to become ready (a readiness check takes at most a quarter of a second)."""
        now = self.clock()
        for name, process in self.stack.supervised().items():
            watched = self._watched.setdefault(name, _Watched(started_at=now))
            if watched.restart_at is not None:
                if now >= watched.restart_at:
                    self.stack.restart(name)
                    self.restarts[name] += 1
                    watched.started_at, watched.restart_at, watched.restarted = now, None, True
            elif process.poll() is not None:
                delay = watched.backoff.delay(now - watched.started_at)
                watched.restart_at = now + delay
                self.notice(
                    f"{name} exited with status {process.returncode}; restart "
                    f"{self.restarts[name] + 1} in {delay:g} s (log: {self.stack.log_path(name)})"
                )
            elif watched.restarted and self.stack.ready(name):
                watched.restarted = False
                self.notice(f"{name} is ready again")

    def summary(self) -> str:
        """The restarts so far, e.g. "restarts: engine 2, redis 1" ("restarts: none")."""
        counts = ", ".join(f"{name} {count}" for name, count in self.restarts.items())
        return f"restarts: {counts or 'none'}"
