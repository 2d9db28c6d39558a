"""TrainingService: the gRPC front of training jobs, a translation of its messages to and from the
JSON form the admission takes and the REST routes use (docs/api.md#training-jobs)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError

from libs.auth.limits import peer_host
from libs.auth.policy import Access, current_caller, methods
from libs.gen.expert.v1 import training_pb2, training_pb2_grpc
from libs.timestamps import timestamp
from libs.training.files import owner_of
from libs.training.jobs import STATUSES, TrainingJob
from services.reception.tolerant import add_refusing_service
from services.reception.training.admission import TrainingAdmission

SERVICE = "expert.v1.TrainingService"
# Changing a job needs a train (or admin) key; reading one's own jobs, any key.
_ACCESS = {
    "CreateTrainingJob": Access.TRAIN,
    "CancelTrainingJob": Access.TRAIN,
    "CheckpointTrainingJob": Access.TRAIN,
    "ResumeTrainingJob": Access.TRAIN,
    "GetTrainingJob": Access.INFER,
    "ListTrainingJobs": Access.INFER,
    "ListTrainingCheckpoints": Access.INFER,
    "ListTrainingJobEvents": Access.INFER,
}
ACCESS = methods(SERVICE, _ACCESS)
STATUS_ENUMS = {status: i for i, status in enumerate(STATUSES, start=1)}


def spec_from_proto(spec: training_pb2.TrainingJobSpec) -> dict[str, Any]:
    """The JSON form of a spec (unset fields left out, so that they take their defaults)."""
    return MessageToDict(spec, preserving_proto_field_name=True)


def _set(message, values: dict[str, Any]) -> None:
    """`message` filled from a stored record's JSON; left empty when the record holds what it cannot
    carry (a number past int32 in a job stored before the specs had ceilings), so that the job is
    still shown, without that part."""
    try:
        ParseDict({k: v for k, v in values.items() if v is not None}, message, ignore_unknown_fields=True)
    except ParseError:
        message.Clear()


def checkpoint_proto(record: dict[str, Any]) -> training_pb2.TrainingCheckpoint:
    return training_pb2.TrainingCheckpoint(
        id=record["id"],
        step=record["step"],
        epoch=record.get("epoch", 0),
        train_loss=record.get("train_loss") or 0.0,
        created_at=timestamp(record["created_at"]),
    )


def job_proto(job: TrainingJob) -> training_pb2.TrainingJob:
    message = training_pb2.TrainingJob(
        id=job.job_id,
        status=STATUS_ENUMS[job.status],
        error=job.error,
        cancel_requested=job.cancel_requested,
        checkpoints=[checkpoint_proto(c) for c in job.public_checkpoints()],
        created_at=timestamp(job.created_at),
        updated_at=timestamp(job.updated_at),
    )
    _set(message.spec, job.spec)
    _set(message.metrics, job.metrics)
    if job.expert:
        _set(message.expert, job.expert)
    if job.started_at is not None:
        message.started_at.CopyFrom(timestamp(job.started_at))
    if job.finished_at is not None:
        message.finished_at.CopyFrom(timestamp(job.finished_at))
    return message


def event_proto(event: dict[str, Any]) -> training_pb2.TrainingJobEvent:
    message = training_pb2.TrainingJobEvent(
        id=event["id"],
        type=event["type"],
        message=event["message"],
        created_at=timestamp(event["created_at"]),
    )
    message.data.update({k: v for k, v in event["data"].items() if v is not None})
    return message


def _owner(context: grpc.aio.ServicerContext) -> str:
    """Whose jobs (and files) the call sees: the same owner as TrainingFileService's."""
    return owner_of(current_caller(), peer_host(context.peer()))


class TrainingServicer(training_pb2_grpc.TrainingServiceServicer):
    def __init__(self, admission: TrainingAdmission) -> None:
        self.admission = admission

    async def CreateTrainingJob(self, request, context: grpc.aio.ServicerContext):
        job = await self.admission.create(_owner(context), spec_from_proto(request.spec))
        return training_pb2.CreateTrainingJobResponse(job=job_proto(job))

    async def GetTrainingJob(self, request, context: grpc.aio.ServicerContext):
        job = await self.admission.get(_owner(context), request.job_id)
        return training_pb2.GetTrainingJobResponse(job=job_proto(job))

    async def ListTrainingJobs(self, request, context: grpc.aio.ServicerContext):
        jobs, more = await self.admission.list(_owner(context), request.limit, request.after)
        return training_pb2.ListTrainingJobsResponse(jobs=[job_proto(j) for j in jobs], has_more=more)

    async def CancelTrainingJob(self, request, context: grpc.aio.ServicerContext):
        job = await self.admission.cancel(_owner(context), request.job_id)
        return training_pb2.CancelTrainingJobResponse(job=job_proto(job))

    async def CheckpointTrainingJob(self, request, context: grpc.aio.ServicerContext):
        checkpoint_id = await self.admission.checkpoint(_owner(context), request.job_id)
        return training_pb2.CheckpointTrainingJobResponse(checkpoint_id=checkpoint_id)

    async def ListTrainingCheckpoints(self, request, context: grpc.aio.ServicerContext):
        records = await self.admission.checkpoints(_owner(context), request.job_id)
        return training_pb2.ListTrainingCheckpointsResponse(
            checkpoints=[checkpoint_proto(c) for c in records]
        )

    async def ResumeTrainingJob(self, request, context: grpc.aio.ServicerContext):
        job = await self.admission.resume(_owner(context), request.job_id, request.checkpoint_id)
        return training_pb2.ResumeTrainingJobResponse(job=job_proto(job))

    async def ListTrainingJobEvents(self, request, context: grpc.aio.ServicerContext):
        events = await self.admission.events(_owner(context), request.job_id, request.after, request.limit)
        return training_pb2.ListTrainingJobEventsResponse(events=[event_proto(e) for e in events])


def add_to_server(servicer: TrainingServicer, server: grpc.aio.Server) -> str:
    """Register the servicer (bad UTF-8 is INVALID_ARGUMENT: tolerant.py)."""
    return add_refusing_service(server, SERVICE, servicer, _ACCESS, training_pb2)
