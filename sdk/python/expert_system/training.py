"""`client.training`: training jobs through the reception's TrainingService and TrainingFileService.

```python
with ExpertClient(api_key=TRAIN_KEY) as client:  # creating jobs and uploading needs a key of scope train
    file = client.training.upload("shout.jsonl")  # a bad line: InvalidRequest naming it (shout.jsonl:3)
    job = client.training.create(file.id, expert={"name": "shouter", "description": "..."},
                                 hyperparameters={"epochs": 2})
    for event in client.training.watch(job.id):  # events until the job is final
        if event.type == "progress":
            print(event.data["step"], event.data["train_loss"])
    client.training.get(job.id).expert.model  # "<base>:shouter", a model id requests can name
```

The spec's sections (`adapter`, `hyperparameters`, `expert`, ...) are the fields of training.proto's
messages as dicts; the server fills in the defaults and refuses a wrong one naming the field.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from ._proto.expert.v1 import files_pb2, files_pb2_grpc, training_pb2, training_pb2_grpc
from .connection import DEFAULT_TIMEOUT
from .errors import InvalidRequest, error_from_aio_call, error_from_call
from .training_results import (
    TrainingCheckpoint,
    TrainingFile,
    TrainingJob,
    TrainingJobEvent,
    checkpoint_from_proto,
    event_from_proto,
    file_from_proto,
    job_from_proto,
)

_Response = TypeVar("_Response")
# Each call's deadline in seconds (None: none).
Timeout = float | None
# The most events one ListTrainingJobEvents call returns.
_EVENTS_PAGE = 1000
# How often `watch` asks for new events while none come.
DEFAULT_POLL_INTERVAL = 0.5


def build_spec(training_file: str, sections: dict[str, Any]) -> training_pb2.TrainingJobSpec:
    """The TrainingJobSpec of `create`'s arguments; a section the proto does not know is an
    InvalidRequest naming it, as the server would."""
    body = {"training_file": training_file, **{k: v for k, v in sections.items() if v is not None}}
    try:
        return json_format.ParseDict(body, training_pb2.TrainingJobSpec())
    except json_format.ParseError as exc:
        reason = str(exc).split("\n")[0]
        raise InvalidRequest("INVALID_ARGUMENT", reason, [("spec", reason)]) from None


def upload_request(file: str | Path | bytes, filename: str | None) -> files_pb2.UploadTrainingFileRequest:
    """`file` is a path to read or the content itself (then `filename` names it, by default data.jsonl)."""
    if isinstance(file, bytes):
        content, name = file, filename or "data.jsonl"
    else:
        path = Path(file)
        content, name = path.read_bytes(), filename or path.name
    return files_pb2.UploadTrainingFileRequest(filename=name, purpose="fine-tune", content=content)


class Training:
    """The training calls of an `ExpertClient` (its `training` attribute)."""

    def __init__(self, channel: grpc.Channel, metadata: list[tuple[str, str]]):
        self._jobs = training_pb2_grpc.TrainingServiceStub(channel)
        self._files = files_pb2_grpc.TrainingFileServiceStub(channel)
        self._metadata = metadata

    def upload(
        self, file: str | Path | bytes, *, filename: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> TrainingFile:
        """Upload a JSONL training file (one sample a line: prompt/completion or messages)."""
        response = self._call(self._files.UploadTrainingFile, upload_request(file, filename), timeout)
        return file_from_proto(response.file)

    def files(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> list[TrainingFile]:
        response = self._call(self._files.ListTrainingFiles, files_pb2.ListTrainingFilesRequest(), timeout)
        return [file_from_proto(f) for f in response.files]

    def delete_file(self, file_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> TrainingFile:
        request = files_pb2.DeleteTrainingFileRequest(file_id=file_id)
        return file_from_proto(self._call(self._files.DeleteTrainingFile, request, timeout).file)

    def create(
        self, training_file: str, *, timeout: Timeout = DEFAULT_TIMEOUT, **sections: Any
    ) -> TrainingJob:
        """Queue a job on an uploaded file; `sections` are TrainingJobSpec's other fields
        (adapter, hyperparameters, expert, validation_file, checkpoint_every_steps, ...)."""
        request = training_pb2.CreateTrainingJobRequest(spec=build_spec(training_file, sections))
        return job_from_proto(self._call(self._jobs.CreateTrainingJob, request, timeout).job)

    def get(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> TrainingJob:
        request = training_pb2.GetTrainingJobRequest(job_id=job_id)
        return job_from_proto(self._call(self._jobs.GetTrainingJob, request, timeout).job)

    def list(
        self, *, limit: int = 0, after: str = "", timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[TrainingJob]:
        """The caller's jobs, newest first (a page of `limit`, after the job id `after`)."""
        request = training_pb2.ListTrainingJobsRequest(limit=limit, after=after)
        return [job_from_proto(j) for j in self._call(self._jobs.ListTrainingJobs, request, timeout).jobs]

    def cancel(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> TrainingJob:
        """A pending job is cancelled at once, a running one stops within a step."""
        request = training_pb2.CancelTrainingJobRequest(job_id=job_id)
        return job_from_proto(self._call(self._jobs.CancelTrainingJob, request, timeout).job)

    def checkpoint(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> str:
        """Ask a running job for a checkpoint after its current step; returns the id it will have."""
        request = training_pb2.CheckpointTrainingJobRequest(job_id=job_id)
        return self._call(self._jobs.CheckpointTrainingJob, request, timeout).checkpoint_id

    def checkpoints(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> list[TrainingCheckpoint]:
        request = training_pb2.ListTrainingCheckpointsRequest(job_id=job_id)
        response = self._call(self._jobs.ListTrainingCheckpoints, request, timeout)
        return [checkpoint_from_proto(c) for c in response.checkpoints]

    def resume(
        self, job_id: str, *, checkpoint_id: str = "", timeout: Timeout = DEFAULT_TIMEOUT
    ) -> TrainingJob:
        """Queue a cancelled or failed job again from `checkpoint_id` (by default its last one)."""
        request = training_pb2.ResumeTrainingJobRequest(job_id=job_id, checkpoint_id=checkpoint_id)
        return job_from_proto(self._call(self._jobs.ResumeTrainingJob, request, timeout).job)

    def events(
        self, job_id: str, *, after: str = "", limit: int = 0, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[TrainingJobEvent]:
        """The job's events after the event id `after`, oldest first."""
        request = training_pb2.ListTrainingJobEventsRequest(job_id=job_id, after=after, limit=limit)
        response = self._call(self._jobs.ListTrainingJobEvents, request, timeout)
        return [event_from_proto(e) for e in response.events]

    def watch(
        self, job_id: str, *, poll_interval: float = DEFAULT_POLL_INTERVAL, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> Iterator[TrainingJobEvent]:
        """Every event of the job, oldest first, as they come, until it is completed, failed or
        cancelled (its last event is then that status). `timeout` is each call's deadline."""
        after = ""
        while True:
            # The status is read before the events, so that the events of a final job are all read.
            done = self.get(job_id, timeout=timeout).done
            events = self.events(job_id, after=after, limit=_EVENTS_PAGE, timeout=timeout)
            yield from events
            after = events[-1].id if events else after
            if done and len(events) < _EVENTS_PAGE:
                return
            if not events:
                time.sleep(poll_interval)

    def _call(self, method: Callable[..., _Response], request, timeout: float | None) -> _Response:
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_call(exc) from None


class AsyncTraining:
    """`Training` for asyncio (an `AsyncExpertClient`'s `training`): the same calls, awaited, and
    `watch` for `async for`."""

    def __init__(self, channel: grpc.aio.Channel, metadata: list[tuple[str, str]]):
        self._jobs = training_pb2_grpc.TrainingServiceStub(channel)
        self._files = files_pb2_grpc.TrainingFileServiceStub(channel)
        self._metadata = metadata

    async def upload(
        self, file: str | Path | bytes, *, filename: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> TrainingFile:
        response = await self._call(self._files.UploadTrainingFile, upload_request(file, filename), timeout)
        return file_from_proto(response.file)

    async def files(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> list[TrainingFile]:
        request = files_pb2.ListTrainingFilesRequest()
        response = await self._call(self._files.ListTrainingFiles, request, timeout)
        return [file_from_proto(f) for f in response.files]

    async def delete_file(self, file_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> TrainingFile:
        request = files_pb2.DeleteTrainingFileRequest(file_id=file_id)
        return file_from_proto((await self._call(self._files.DeleteTrainingFile, request, timeout)).file)

    async def create(
        self, training_file: str, *, timeout: Timeout = DEFAULT_TIMEOUT, **sections: Any
    ) -> TrainingJob:
        request = training_pb2.CreateTrainingJobRequest(spec=build_spec(training_file, sections))
        return job_from_proto((await self._call(self._jobs.CreateTrainingJob, request, timeout)).job)

    async def get(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> TrainingJob:
        request = training_pb2.GetTrainingJobRequest(job_id=job_id)
        return job_from_proto((await self._call(self._jobs.GetTrainingJob, request, timeout)).job)

    async def list(
        self, *, limit: int = 0, after: str = "", timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[TrainingJob]:
        request = training_pb2.ListTrainingJobsRequest(limit=limit, after=after)
        response = await self._call(self._jobs.ListTrainingJobs, request, timeout)
        return [job_from_proto(j) for j in response.jobs]

    async def cancel(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> TrainingJob:
        request = training_pb2.CancelTrainingJobRequest(job_id=job_id)
        return job_from_proto((await self._call(self._jobs.CancelTrainingJob, request, timeout)).job)

    async def checkpoint(self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> str:
        request = training_pb2.CheckpointTrainingJobRequest(job_id=job_id)
        return (await self._call(self._jobs.CheckpointTrainingJob, request, timeout)).checkpoint_id

    async def checkpoints(
        self, job_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[TrainingCheckpoint]:
        request = training_pb2.ListTrainingCheckpointsRequest(job_id=job_id)
        response = await self._call(self._jobs.ListTrainingCheckpoints, request, timeout)
        return [checkpoint_from_proto(c) for c in response.checkpoints]

    async def resume(
        self, job_id: str, *, checkpoint_id: str = "", timeout: Timeout = DEFAULT_TIMEOUT
    ) -> TrainingJob:
        request = training_pb2.ResumeTrainingJobRequest(job_id=job_id, checkpoint_id=checkpoint_id)
        return job_from_proto((await self._call(self._jobs.ResumeTrainingJob, request, timeout)).job)

    async def events(
        self, job_id: str, *, after: str = "", limit: int = 0, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[TrainingJobEvent]:
        request = training_pb2.ListTrainingJobEventsRequest(job_id=job_id, after=after, limit=limit)
        response = await self._call(self._jobs.ListTrainingJobEvents, request, timeout)
        return [event_from_proto(e) for e in response.events]

    async def watch(
        self, job_id: str, *, poll_interval: float = DEFAULT_POLL_INTERVAL, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> AsyncIterator[TrainingJobEvent]:
        """`Training.watch`: `async for event in client.training.watch(job_id)`."""
        after = ""
        while True:
            done = (await self.get(job_id, timeout=timeout)).done
            events = await self.events(job_id, after=after, limit=_EVENTS_PAGE, timeout=timeout)
            for event in events:
                yield event
            after = events[-1].id if events else after
            if done and len(events) < _EVENTS_PAGE:
                return
            if not events:
                await asyncio.sleep(poll_interval)

    async def _call(self, method: Callable[..., Any], request, timeout: float | None) -> Any:
        call = method(request, timeout=timeout, metadata=self._metadata)
        try:
            return await call
        except grpc.aio.AioRpcError:
            raise await error_from_aio_call(call) from None
