"""Removing the checkpoint directories of training jobs past their retention
(EXPERT_TRAINING_JOB_RETENTION_SECONDS, libs/training/retention.py).

Every trainer sweeps the shared checkpoint directory when it starts and between jobs, at most once
every ten minutes (sooner for a shorter retention); trainers sweeping at once only race to remove
the same directories, which is harmless. A job's directory goes once the job has been final for the
retention (its record, which expires then too, says since when); a directory whose record is gone
(expired, or lost with a Redis restarted empty) goes once it has not changed for the retention, so a
Redis that lost its data does not take the newer checkpoints with it. A live job's directory stays.
The expert a job produced is in the expert store and stays there.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

from libs.logging import get_logger
from libs.training.jobs import ID_PREFIX, TrainingJob, TrainingJobs

log = get_logger(__name__)
MAX_INTERVAL_S = 600.0


class CheckpointSweeper:
    def __init__(self, directory: Path, jobs: TrainingJobs, retention_s: float) -> None:
        self.directory = directory
        self.jobs = jobs
        self.retention_s = retention_s
        self.interval_s = min(MAX_INTERVAL_S, retention_s)
        self._last: float | None = None  # time.monotonic() of the last sweep

    async def sweep_if_due(self) -> list[str]:
        """Sweep unless the last sweep was less than an interval ago; the job ids removed."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval_s:
            return []
        self._last = now
        return await self.sweep()

    async def sweep(self, now: float | None = None) -> list[str]:
        """Remove the directories of the jobs past their retention (at wall-clock time `now`)."""
        now = time.time() if now is None else now
        removed = []
        for path in sorted(self.directory.glob(f"{ID_PREFIX}*")):
            if not path.is_dir() or not self._expired(await self.jobs.get(path.name), path, now):
                continue
            try:
                await asyncio.to_thread(shutil.rmtree, path)
            except FileNotFoundError:
                pass  # another trainer removed it first
            except OSError as error:
                log.warning("could not remove a training job's checkpoints", path=str(path), error=str(error))
                continue
            removed.append(path.name)
        if removed:
            log.info("removed the checkpoints of jobs past their retention", jobs=removed)
        return removed

    def _expired(self, job: TrainingJob | None, path: Path, now: float) -> bool:
        if job is not None:
            ended = job.finished_at or job.updated_at
            return job.final and ended + self.retention_s <= now
        try:
            changed = path.stat().st_mtime  # the last checkpoint written in it
        except FileNotFoundError:
            return False
        return changed + self.retention_s <= now
