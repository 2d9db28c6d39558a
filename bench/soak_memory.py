"""The soak's memory figures (bench/soak.py): every service's RSS sampled through the load, read at
1, 5 and 10 minutes, and its growth after the first minute.

The first minute is the warm-up a service is allowed (caches fill, pools reach their size, the
allocator finds its arenas); past it, a bounded service stays flat, so growth from the 1-minute
mark to the end of the load is the figure to watch: at or above GROWTH_LIMIT it fails the soak.
redis-server is sampled too but not held to it: it keeps each job's record for
EXPERT_JOB_TTL_SECONDS, so it grows with the jobs by design (the soak reports it per job).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

GROWTH_LIMIT = 0.05  # of the RSS at 1 minute
MARKS_S = (60, 300, 600)  # the minutes the report shows (those within the load)
SAMPLE_EVERY_S = 2.0


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def rss_by_service(pids: dict[str, int]) -> dict[str, int | None]:
    return {name: rss_kib(pid) for name, pid in pids.items()}


class RssSampler:
    """Samples every process's RSS on a thread from `start()` (the start of the load) to `stop()`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, dict[str, int | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._began = 0.0

    def start(self) -> None:
        self._began = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Ends the sampling with one last sample (the end of the load)."""
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic() - self._began, rss_by_service(self.pids)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._began, rss_by_service(self.pids)))
            self._stop.wait(SAMPLE_EVERY_S)

    def at(self, seconds: float) -> dict[str, int | None] | None:
        """The first sample at or after `seconds` into the load (None when the load was shorter)."""
        return next((rss for t, rss in self.samples if t >= seconds), None)

    def marks(self, load_s: float) -> dict[str, dict[str, int | None]]:
        """RSS at each mark within the load ("1 min", "5 min", ...) and at its end ("end")."""
        found = {f"{s // 60} min": self.at(s) for s in MARKS_S if s <= load_s + SAMPLE_EVERY_S}
        found = {name: rss for name, rss in found.items() if rss is not None}
        if self.samples:
            found["end"] = self.samples[-1][1]
        return found


def growth(marks: dict[str, dict[str, int | None]]) -> dict[str, float | None]:
    """Per process: (RSS at the end - RSS at 1 minute) / RSS at 1 minute; None without both."""
    first, end = marks.get("1 min"), marks.get("end")
    if first is None or end is None:
        return {}
    return {
        name: None
        if first.get(name) is None or end.get(name) is None
        else (end[name] - first[name]) / first[name]
        for name in first
    }


def growth_ok(growths: dict[str, float | None], exempt: str) -> bool:
    """Every process but `exempt` grew less than GROWTH_LIMIT after the first minute (and was measured)."""
    held = {name: g for name, g in growths.items() if name != exempt}
    return bool(held) and all(g is not None and g < GROWTH_LIMIT for g in held.values())


def print_rss(
    marks: dict[str, dict[str, int | None]], growths: dict[str, float | None], names: list[str]
) -> None:
    columns = list(marks)
    print(f"\n{'RSS MiB':<14}" + "".join(f"{c:>10}" for c in columns) + f"{'after 1 min':>13}")
    for name in names:
        cells = []
        for column in columns:
            value = marks[column].get(name)
            cells.append(f"{'n/a':>10}" if value is None else f"{value / 1024:>10.1f}")
        g = growths.get(name)
        print(f"{name:<14}" + "".join(cells) + (f"{'n/a':>13}" if g is None else f"{g:>+12.1%} "))
