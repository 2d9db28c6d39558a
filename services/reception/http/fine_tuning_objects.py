"""Training jobs, their events and checkpoints in OpenAI's fine-tuning object shapes
(`fine_tuning.job`, `fine_tuning.job.event`, `fine_tuning.job.checkpoint`); times in whole seconds.

A job is checked (its files read, its bounds applied) before it is stored, so `validating_files` is
never seen: a stored job is `queued` until the trainer takes it. A running job asked to stop stays
`running` until the trainer stops it within a step, then reads `cancelled`. Any stored record renders:
one kept from before the specs had ceilings shows what it cannot show as null."""

from __future__ import annotations

import math
import time
from typing import Any

from libs.training.jobs import TrainingJob
from libs.training.settings import DEFAULT_LEARNING_RATES

STATUS = {
    "PENDING": "queued",
    "RUNNING": "running",
    "CHECKPOINTING": "running",
    "COMPLETED": "succeeded",
    "FAILED": "failed",
    "CANCELLED": "cancelled",
}


def _seconds(value: float | None) -> int | None:
    return None if value is None else int(value)


def _error(job: TrainingJob) -> dict[str, Any]:
    return {"code": "training_failed", "message": job.error or "the job failed", "param": None}


def _section(spec: dict[str, Any], name: str) -> dict[str, Any]:
    value = spec.get(name)
    return value if isinstance(value, dict) else {}


def _multiplier(spec: dict[str, Any]) -> float | None:
    """The job's learning rate as OpenAI's multiplier of its adapter's default; None when the record
    holds none that can be shown (one stored before the rates had a ceiling may not)."""
    rate = _section(spec, "hyperparameters").get("learning_rate")
    kind = str(_section(spec, "adapter").get("type", "lora")).replace("_", "-")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or kind not in DEFAULT_LEARNING_RATES:
        return None
    multiplier = rate / DEFAULT_LEARNING_RATES[kind]
    return round(multiplier, 6) if math.isfinite(multiplier) else None


def job_object(job: TrainingJob) -> dict[str, Any]:
    spec, metrics = job.spec, job.metrics
    hyper = _section(spec, "hyperparameters")
    hyperparameters = {
        "n_epochs": hyper.get("epochs"),
        "batch_size": hyper.get("batch_size"),
        "learning_rate_multiplier": _multiplier(spec),
    }
    status = STATUS[job.status]
    eta = metrics.get("eta_seconds")
    return {
        "object": "fine_tuning.job",
        "id": job.job_id,
        "model": spec.get("base_model", ""),
        "created_at": int(job.created_at),
        "finished_at": _seconds(job.finished_at) if job.final else None,
        "fine_tuned_model": (job.expert or {}).get("model") if status == "succeeded" else None,
        "organization_id": job.owner,
        "result_files": [],
        "status": status,
        "validation_file": spec.get("validation_file") or None,
        "training_file": spec.get("training_file", ""),
        "hyperparameters": hyperparameters,
        "trained_tokens": metrics.get("trained_tokens") if status == "succeeded" else None,
        "error": _error(job) if status == "failed" else None,
        "estimated_finish": int(time.time() + eta) if status == "running" and eta is not None else None,
        "integrations": None,
        "metadata": None,
        "seed": hyper.get("seed", 0),
        "user_provided_suffix": _section(spec, "expert").get("name"),
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    }


def event_object(event: dict[str, Any]) -> dict[str, Any]:
    """A job event: progress reports are `metrics`, the rest `message`; a failure is an error."""
    failed = event["type"] == "status" and event["data"].get("status") == "FAILED"
    return {
        "object": "fine_tuning.job.event",
        "id": event["id"],
        "created_at": int(event["created_at"]),
        "level": "error" if failed else "info",
        "message": event["message"],
        "data": event["data"],
        "type": "metrics" if event["type"] == "progress" else "message",
    }


def checkpoint_object(job_id: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint is a point to resume the job from (POST /v1/training/jobs/{id}/resume), not a
    model one can call: `fine_tuned_model_checkpoint` is its id."""
    return {
        "object": "fine_tuning.job.checkpoint",
        "id": checkpoint["id"],
        "created_at": int(checkpoint["created_at"]),
        "fine_tuned_model_checkpoint": checkpoint["id"],
        "fine_tuning_job_id": job_id,
        "step_number": checkpoint["step"],
        "metrics": {"step": checkpoint["step"], "train_loss": checkpoint.get("train_loss")},
    }
