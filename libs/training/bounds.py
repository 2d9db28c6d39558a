"""Every ceiling of a training job, in one place. The fixed ones (module constants, each with why
that value) bound what makes sense at all and are checked wherever settings are made (TrainSettings,
so `expertctl expert train` too, and the job spec's reader). The ones an operator may want to move
are `TrainingBounds`, from EXPERT_TRAINING_MAX_* (read by reception, which refuses a job over a
bound at submission, and by the trainer, which enforces the time budget and the sequence length
while it trains)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from libs.config import EnvReader

# A job's integers travel as int32 in the gRPC messages (protos/expert/v1/training.proto): no bound
# may exceed it, or a stored job could not be shown to a gRPC caller.
INT32_MAX = 2**31 - 1
# LoRA's alpha scales the update by alpha / rank: peft's examples use alpha of one to two ranks, so
# 4096 covers twice the largest rank anyone trains an adapter of a small model with (2048); far
# above, the first steps diverge.
MAX_ALPHA = 4096.0
# AdamW steps of 1 or more diverge at once; the largest published adapter rate is prompt tuning's
# 0.3 (Lester et al., 2021), and the defaults here are 1e-3 to 3e-2 (settings.DEFAULT_LEARNING_RATES).
MAX_LEARNING_RATE = 1.0
# OpenAI's learning_rate_multiplier scales the LoRA default of 1e-3: OpenAI's guide suggests values
# around 0.02 to 2; 10 (a rate of 1e-2) is already past where LoRA training of a small model stays
# stable, and keeps the resulting rate far below MAX_LEARNING_RATE.
MAX_LEARNING_RATE_MULTIPLIER = 10.0
# Prompt tuning's gains level off by about 100 virtual tokens (Lester et al., 2021); every one is a
# position each sample gives up, so more than 512 leaves little room for text at the default length.
MAX_VIRTUAL_TOKENS = 512
# A seed is an int32 on the wire (INT32_MAX), and any value in it seeds Python, NumPy and torch alike.
MAX_SEED = INT32_MAX
# The modules one adapter may name: the seven projections of a decoder layer, with room for dotted
# forms ("self_attn.q_proj"); the manifest allows as many (libs/experts/manifest.py).
MAX_MODULES = 64


@dataclass(frozen=True)
class TrainingBounds:
    max_steps: int = 10_000  # optimizer steps of one job
    max_samples: int = 100_000  # lines of its training file (and of its validation file)
    max_sequence_length: int = 2048  # tokens of one sample
    max_seconds: int = 21_600  # training time of one job, all its runs together
    # OpenAI's fine-tuning takes 1 to 50 epochs; past that an adapter only memorises its file.
    max_epochs: int = 50
    # OpenAI's ceiling on batch_size; activation memory grows with it, the reason to lower it.
    max_batch_size: int = 256
    # A LoRA adapter's size and memory grow with its rank; peft's examples use 8 to 64, and 256 is
    # more than a small model's adapter gains from.
    max_rank: int = 256

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainingBounds:
        reader, d = EnvReader(env), cls()

        def bound(name: str, default: int, minimum: int = 1) -> int:
            return reader.integer(name, default, minimum=minimum, maximum=INT32_MAX)

        return cls(
            max_steps=bound("EXPERT_TRAINING_MAX_STEPS", d.max_steps),
            max_samples=bound("EXPERT_TRAINING_MAX_SAMPLES", d.max_samples),
            max_sequence_length=bound("EXPERT_TRAINING_MAX_SEQUENCE_LENGTH", d.max_sequence_length, 2),
            max_seconds=bound("EXPERT_TRAINING_MAX_SECONDS", d.max_seconds),
            max_epochs=bound("EXPERT_TRAINING_MAX_EPOCHS", d.max_epochs),
            max_batch_size=bound("EXPERT_TRAINING_MAX_BATCH_SIZE", d.max_batch_size),
            max_rank=bound("EXPERT_TRAINING_MAX_RANK", d.max_rank),
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


def setting_violations(bounds: TrainingBounds, spec: dict) -> list[tuple[str, str]]:
    """(field, reason) for each of a parsed spec's settings (its JSON form, JobSpec.to_dict) over a
    bound of this deployment, whatever its files hold."""
    adapter, hyper = spec["adapter"], spec["hyperparameters"]
    steps, length = bounds.max_steps, bounds.max_sequence_length
    given = (
        ("adapter.rank", adapter.get("rank", 0), bounds.max_rank, "RANK"),
        ("hyperparameters.epochs", hyper["epochs"], bounds.max_epochs, "EPOCHS"),
        ("hyperparameters.batch_size", hyper["batch_size"], bounds.max_batch_size, "BATCH_SIZE"),
        # A patience longer than every epoch a job may train never stops one early.
        ("hyperparameters.patience", hyper["patience"], bounds.max_epochs, "EPOCHS"),
        ("hyperparameters.max_steps", hyper["max_steps"], steps, "STEPS"),
        # A checkpoint every more steps than a job may take would never come.
        ("checkpoint_every_steps", spec["checkpoint_every_steps"], steps, "STEPS"),
        ("hyperparameters.max_sequence_length", hyper["max_sequence_length"], length, "SEQUENCE_LENGTH"),
        ("time_budget_seconds", spec["time_budget_seconds"], bounds.max_seconds, "SECONDS"),
    )
    problems = [
        (name, f"{value}, over the {most} allowed (EXPERT_TRAINING_MAX_{variable})")
        for name, value, most, variable in given
        if value > most
    ]
    virtual = adapter.get("num_virtual_tokens", 0)
    room = hyper["max_sequence_length"] or length
    if virtual >= room:
        problems.append(
            (
                "adapter.num_virtual_tokens",
                f"{virtual} virtual tokens leave no room for text in samples of {room} tokens "
                "(hyperparameters.max_sequence_length, else EXPERT_TRAINING_MAX_SEQUENCE_LENGTH)",
            )
        )
    return problems


def bound_violations(
    bounds: TrainingBounds,
    *,
    steps: int,
    max_steps_given: bool,
    samples: dict[str, int],
) -> list[tuple[str, str]]:
    """(field, reason) for each bound the job's files take it over; `samples` maps a file field to
    its lines, `steps` is what its epochs take over them (planned_steps)."""
    problems = []
    for name, count in samples.items():
        if count > bounds.max_samples:
            problems.append(
                (
                    name,
                    f"{count} samples, over the {bounds.max_samples} allowed (EXPERT_TRAINING_MAX_SAMPLES)",
                )
            )
    if steps > bounds.max_steps and not max_steps_given:
        problems.append(
            (
                "hyperparameters.epochs",
                f"the job would take {steps} steps, over the {bounds.max_steps} allowed "
                "(EXPERT_TRAINING_MAX_STEPS): train fewer epochs or set hyperparameters.max_steps",
            )
        )
    return problems
