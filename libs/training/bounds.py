"""The resources one training job may take, from EXPERT_TRAINING_MAX_* (read by reception, which
refuses a job over a bound at submission, and by the trainer, which enforces the time budget and
the sequence length while it trains)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from libs.config import EnvReader


@dataclass(frozen=True)
class TrainingBounds:
    max_steps: int = 10_000  # optimizer steps of one job
    max_samples: int = 100_000  # lines of its training file (and of its validation file)
    max_sequence_length: int = 2048  # tokens of one sample
    max_seconds: int = 21_600  # training time of one job, all its runs together

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainingBounds:
        reader, d = EnvReader(env), cls()
        return cls(
            max_steps=reader.integer("EXPERT_TRAINING_MAX_STEPS", d.max_steps, minimum=1),
            max_samples=reader.integer("EXPERT_TRAINING_MAX_SAMPLES", d.max_samples, minimum=1),
            max_sequence_length=reader.integer(
                "EXPERT_TRAINING_MAX_SEQUENCE_LENGTH", d.max_sequence_length, minimum=2
            ),
            max_seconds=reader.integer("EXPERT_TRAINING_MAX_SECONDS", d.max_seconds, minimum=1),
        )


def planned_steps(
    samples: int, has_validation_file: bool, epochs: int, batch: int, eval_fraction: float
) -> int:
    """The optimizer steps `epochs` take over `samples` training lines (the held-out share set aside
    when there is no validation file), as the trainer counts them."""
    held_out = 0
    if not has_validation_file and eval_fraction > 0:
        held_out = max(1, round(samples * eval_fraction))
    return math.ceil(max(0, samples - held_out) / batch) * epochs


def bound_violations(
    bounds: TrainingBounds,
    *,
    steps: int,
    max_steps_given: bool,
    samples: dict[str, int],
    max_sequence_length: int | None,
    time_budget_seconds: int,
) -> list[tuple[str, str]]:
    """(field, reason) for each bound a job goes over; `samples` maps a file field to its lines."""
    problems = []
    for name, count in samples.items():
        if count > bounds.max_samples:
            problems.append(
                (
                    name,
                    f"{count} samples, over the {bounds.max_samples} allowed (EXPERT_TRAINING_MAX_SAMPLES)",
                )
            )
    if steps > bounds.max_steps:
        name = "hyperparameters.max_steps" if max_steps_given else "hyperparameters.epochs"
        problems.append(
            (
                name,
                f"the job would take {steps} steps, over the {bounds.max_steps} allowed "
                "(EXPERT_TRAINING_MAX_STEPS): train fewer epochs or set hyperparameters.max_steps",
            )
        )
    if max_sequence_length is not None and max_sequence_length > bounds.max_sequence_length:
        problems.append(
            (
                "hyperparameters.max_sequence_length",
                f"{max_sequence_length} tokens, over the {bounds.max_sequence_length} allowed "
                "(EXPERT_TRAINING_MAX_SEQUENCE_LENGTH)",
            )
        )
    if time_budget_seconds > bounds.max_seconds:
        problems.append(
            (
                "time_budget_seconds",
                f"{time_budget_seconds} s, over the {bounds.max_seconds} allowed "
                "(EXPERT_TRAINING_MAX_SECONDS)",
            )
        )
    return problems
