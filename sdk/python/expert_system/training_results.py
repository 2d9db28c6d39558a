"""What `client.training` returns: frozen dataclasses built from training.proto and files.proto,
with the conventions of `results` (lower-case status names, UTC datetimes, tuples, None for unset)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from google.protobuf import json_format

from ._proto.expert.v1 import files_pb2, training_pb2
from .results import _datetime, _enum_names

_STATUS = _enum_names(training_pb2.TrainingJobStatus, "TRAINING_JOB_STATUS_")
# A job in one of these never changes again (until a `resume` of a cancelled or failed one).
FINAL_TRAINING_STATUSES = frozenset({"completed", "failed", "cancelled"})


def training_status_name(value: int) -> str:
    """ "running" for TRAINING_JOB_STATUS_RUNNING; the number as text for a newer value."""
    return _STATUS.get(value, str(value))


def _optional(message, field: str) -> float | None:
    return getattr(message, field) if message.HasField(field) else None


@dataclass(frozen=True)
class TrainingFile:
    """An uploaded training file (without its content)."""

    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: datetime | None


def file_from_proto(message: files_pb2.TrainingFile) -> TrainingFile:
    return TrainingFile(
        id=message.file_id,
        filename=message.filename,
        purpose=message.purpose,
        bytes=message.bytes,
        created_at=_datetime(message, "created_at"),
    )


@dataclass(frozen=True)
class TrainingMetrics:
    """Where a job stands: its step of `total_steps`, losses, speed and estimated time left."""

    step: int
    total_steps: int
    epoch: int
    epochs: int
    train_loss: float | None
    eval_loss: float | None
    tokens_per_second: float
    eta_seconds: float | None
    training_seconds: float


def metrics_from_proto(message: training_pb2.TrainingMetrics) -> TrainingMetrics:
    return TrainingMetrics(
        step=message.step,
        total_steps=message.total_steps,
        epoch=message.epoch,
        epochs=message.epochs,
        train_loss=_optional(message, "train_loss"),
        eval_loss=_optional(message, "eval_loss"),
        tokens_per_second=message.tokens_per_second,
        eta_seconds=_optional(message, "eta_seconds"),
        training_seconds=message.training_seconds,
    )


@dataclass(frozen=True)
class TrainingCheckpoint:
    id: str
    step: int
    epoch: int
    train_loss: float
    created_at: datetime | None


def checkpoint_from_proto(message: training_pb2.TrainingCheckpoint) -> TrainingCheckpoint:
    return TrainingCheckpoint(
        id=message.id,
        step=message.step,
        epoch=message.epoch,
        train_loss=message.train_loss,
        created_at=_datetime(message, "created_at"),
    )


@dataclass(frozen=True)
class TrainedExpert:
    """The expert a completed job installed; `model` ("<base>:<expert>") is what requests name."""

    name: str
    version: str
    content_hash: str
    adapter_type: str
    model: str


@dataclass(frozen=True)
class TrainingJob:
    """A training job. `spec` is the job's TrainingJobSpec as JSON (the trainer's defaults filled
    in); `expert` is set once it is "completed", `error` says why it "failed"."""

    id: str
    status: str
    spec: dict[str, Any]
    metrics: TrainingMetrics
    checkpoints: tuple[TrainingCheckpoint, ...]
    expert: TrainedExpert | None
    error: str
    cancel_requested: bool
    created_at: datetime | None
    updated_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def done(self) -> bool:
        return self.status in FINAL_TRAINING_STATUSES


def job_from_proto(message: training_pb2.TrainingJob) -> TrainingJob:
    expert = None
    if message.HasField("expert"):
        e = message.expert
        expert = TrainedExpert(e.name, e.version, e.content_hash, e.adapter_type, e.model)
    return TrainingJob(
        id=message.id,
        status=training_status_name(message.status),
        spec=json_format.MessageToDict(message.spec, preserving_proto_field_name=True),
        metrics=metrics_from_proto(message.metrics),
        checkpoints=tuple(checkpoint_from_proto(c) for c in message.checkpoints),
        expert=expert,
        error=message.error,
        cancel_requested=message.cancel_requested,
        created_at=_datetime(message, "created_at"),
        updated_at=_datetime(message, "updated_at"),
        started_at=_datetime(message, "started_at"),
        finished_at=_datetime(message, "finished_at"),
    )


@dataclass(frozen=True)
class TrainingJobEvent:
    """One event of a job: `type` is "status", "progress", "epoch" or "checkpoint"; `data` holds its
    figures (a progress event: step, total_steps, train_loss, tokens_per_second, eta_seconds)."""

    id: str
    type: str
    message: str
    data: dict[str, Any]
    created_at: datetime | None


def event_from_proto(message: training_pb2.TrainingJobEvent) -> TrainingJobEvent:
    return TrainingJobEvent(
        id=message.id,
        type=message.type,
        message=message.message,
        data=json_format.MessageToDict(message.data),
        created_at=_datetime(message, "created_at"),
    )
