"""The control a job's training run reports to and is steered by (libs.training.control), called
from the training thread between steps.

After each step it records the metrics and a progress event, and reads back what was asked of the
job: a checkpoint is written every N steps and when asked for; the run stops for a cancel, when
the job's time budget is spent, when another trainer took the job (its lease was lost), or when
this trainer stops (after a last checkpoint, so the job goes on where it was). Redis is reached
through the worker's event loop (`call`), so the thread and the loop share one client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.logging import get_logger
from libs.training.control import Control, SaveCheckpoint, StepInfo, TrainingStopped
from libs.training.jobs import CHECKPOINTING, RUNNING, TrainingJobs, new_checkpoint_id
from services.trainer.metrics import TrainerMetrics

log = get_logger(__name__)
CALL_TIMEOUT_S = 30.0


class Cancelled(TrainingStopped):
    """The job was cancelled."""


class BudgetSpent(TrainingStopped):
    """The job trained for its whole time budget."""


class Interrupted(TrainingStopped):
    """The job was taken from this trainer: its lease lost, or the trainer stopping."""


@dataclass
class Stops:
    """What the worker asks of a run from outside it (set from the event loop)."""

    lease_lost: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)


@dataclass
class JobControl(Control):
    jobs: TrainingJobs
    job_id: str
    loop: asyncio.AbstractEventLoop
    directory: Path  # the job's checkpoints go under it
    every: int  # steps between checkpoints
    budget_s: float
    spent_s: float  # training seconds of earlier runs of the job
    checkpoints: list[dict[str, Any]]
    resume: Path | None
    stops: Stops
    metrics: TrainerMetrics | None = None
    started: float = field(default_factory=time.monotonic)
    steps_at_start: int | None = None

    def call(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(CALL_TIMEOUT_S)

    def resume_from(self) -> Path | None:
        return self.resume

    def training_seconds(self) -> float:
        return self.spent_s + time.monotonic() - self.started

    def after_step(self, info: StepInfo, save: SaveCheckpoint) -> None:
        if self.metrics is not None:
            self.metrics.steps.inc()
        if self.stops.lease_lost.is_set():
            raise Interrupted("another trainer holds the job now")
        if self.stops.stopping.is_set():
            self._checkpoint(info, save, "the trainer is stopping")
            raise Interrupted("the trainer is stopping")
        cancel, asked = self._report(info)
        if cancel:
            raise Cancelled("cancelled")
        if asked or info.step % self.every == 0:
            self._checkpoint(info, save, "asked for" if asked else f"every {self.every} steps", asked)
        if self.training_seconds() > self.budget_s:
            raise BudgetSpent(
                f"the job's time budget of {self.budget_s:.0f} s is spent (time_budget_seconds, at most "
                "EXPERT_TRAINING_MAX_SECONDS); its checkpoints are kept: resume it with a larger budget"
            )

    def after_epoch(self, epoch: int, train_loss: float, eval_loss: float | None) -> None:
        held_out = "-" if eval_loss is None else f"{eval_loss:.4f}"
        data = {"epoch": epoch, "train_loss": train_loss, "eval_loss": eval_loss}
        self._quietly(
            lambda: self.jobs.event(self.job_id, "epoch", f"epoch {epoch}: held-out loss {held_out}", data)
        )

    def _report(self, info: StepInfo) -> tuple[bool, str]:
        if self.steps_at_start is None:
            self.steps_at_start = info.step - 1
        done_here = info.step - self.steps_at_start
        elapsed = time.monotonic() - self.started
        eta = (info.total_steps - info.step) * elapsed / done_here if done_here else None
        metrics = {
            "step": info.step,
            "total_steps": info.total_steps,
            "epoch": info.epoch,
            "epochs": info.epochs,
            "train_loss": info.loss,
            "eval_loss": info.eval_loss,
            "tokens_per_second": info.tokens_per_second,
            "eta_seconds": eta,
            "training_seconds": self.training_seconds(),
        }
        flags = self._quietly(lambda: self.jobs.report_step(self.job_id, metrics))
        return flags or (False, "")

    def _checkpoint(self, info: StepInfo, save: SaveCheckpoint, why: str, asked_for: str = "") -> None:
        checkpoint_id = asked_for or new_checkpoint_id()
        path = self.directory / checkpoint_id
        self.call(lambda: self.jobs.transition(self.job_id, (RUNNING,), CHECKPOINTING))
        save(path)
        if self.metrics is not None:
            self.metrics.checkpoints.inc()
        record = {
            "id": checkpoint_id,
            "step": info.step,
            "epoch": info.epoch,
            "train_loss": info.loss,
            "created_at": time.time(),
            "training_seconds": self.training_seconds(),
            "path": str(path),
        }
        self.checkpoints.append(record)
        self.call(
            lambda: self.jobs.update(self.job_id, checkpoints=self.checkpoints, checkpoint_requested="")
        )
        self.call(lambda: self.jobs.transition(self.job_id, (CHECKPOINTING,), RUNNING))
        public = {k: v for k, v in record.items() if k != "path"}
        self._quietly(
            lambda: self.jobs.event(
                self.job_id, "checkpoint", f"checkpoint at step {info.step} ({why})", public
            )
        )

    def _quietly(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """A report that may fail (Redis away for a moment) without stopping the training."""
        try:
            return self.call(make)
        except Exception as error:  # the lease decides whether the job is still ours, not one report
            log.warning("a training report failed", job_id=self.job_id, error=str(error))
            return None
