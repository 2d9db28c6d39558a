"""Training jobs, their events and checkpoints in OpenAI's fine-tuning object shapes
(`fine_tuning.job`, `fine_tuning.job.event`, `fine_tuning.job.checkpoint`); times in whole seconds.

A job is checked (its files read, its bounds applied) before it is stored, so `validating_files` is
never seen: a stored job is `queued` until the trainer takes it. A running job asked to stop stays
`running` until the trainer stops it within a step, then reads `cancelled`."""

from __future__ import annotations

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


def job_object(job: TrainingJob) -> dict[str, Any]:
    spec, metrics = job.spec, job.metrics
    hyper = spec.get("hyperparameters", {})
    adapter_type = spec.get("adapter", {}).get("type", "lora").replace("_", "-")
    multiplier = hyper.get("learning_rate", 0) / DEFAULT_LEARNING_RATES[adapter_type]
    hyperparameters = {
        "n_epochs": hyper.get("epochs"),
        "batch_size": hyper.get("batch_size"),
        "learning_rate_multiplier": round(multiplier, 6),
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
        "user_provided_suffix": spec.get("expert", {}).get("name"),
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
