"""What a training run tells its owner after each step and epoch, and how the owner steers it.

`expertctl expert train` runs without a control. The trainer worker passes one that reports
progress, writes checkpoints (every N steps, or when asked), stops the run when the job is
cancelled or its time budget is spent, and hands the run the checkpoint to resume from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class TrainingStopped(Exception):
    """The control stopped the run between two steps (a cancel, a lost lease, a spent time budget);
    the message says why. What was checkpointed stays."""


@dataclass(frozen=True)
class StepInfo:
    step: int  # optimizer steps done in the whole run
    total_steps: int
    epoch: int
    epochs: int
    loss: float  # mean loss per learned token of the epoch so far
    tokens_per_second: float
    eval_loss: float | None  # the last held-out loss (None before the first epoch ends)


SaveCheckpoint = Callable[[Path], None]  # writes the run's whole state into a new directory


class Control:
    """The no-op control; the worker's subclass overrides what it needs."""

    def resume_from(self) -> Path | None:
        """The checkpoint directory to continue from, None to start afresh."""
        return None

    def after_step(self, info: StepInfo, save: SaveCheckpoint) -> None:
        """Called after every optimizer step; may `save` a checkpoint or raise TrainingStopped."""

    def after_epoch(self, epoch: int, train_loss: float, eval_loss: float | None) -> None:
        """Called when an epoch ends, after its held-out evaluation."""
