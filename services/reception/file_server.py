"""TrainingFileService: training files over gRPC (docs/api.md, TrainingFileService), the very files
of the HTTP front's /v1/files (libs.training.files), checked alike (training_uploads). Every RPC needs a
train (or admin) key; a file is the caller's alone (owner_of: its API key), another's is NOT_FOUND.
Redis down is the error mapper's UNAVAILABLE; an owner at EXPERT_TRAINING_FILES_PER_OWNER, or Redis
full (files have no TTL, so nothing of theirs is evicted), is RESOURCE_EXHAUSTED, nothing written."""

from __future__ import annotations

import re

import grpc
from redis.exceptions import OutOfMemoryError

from libs.auth.limits import peer_host
from libs.auth.policy import Access, current_caller, methods
from libs.errors import invalid_argument, not_found, resource_exhausted
from libs.gen.expert.v1 import files_pb2
from libs.timestamps import timestamp
from libs.training.files import TrainingFile, TrainingFiles, owner_of
from services.reception.tolerant import add_tolerant_service, parsed
from services.reception.training_uploads import (
    UploadLimits,
    UploadRefused,
    check_content,
    check_filename,
    check_purpose,
    keep,
)

SERVICE = "expert.v1.TrainingFileService"
_METHODS = (
    "UploadTrainingFile",
    "GetTrainingFile",
    "ListTrainingFiles",
    "GetTrainingFileContent",
    "DeleteTrainingFile",
)
ACCESS = methods(SERVICE, dict.fromkeys(_METHODS, Access.TRAIN))
_FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")


def file_proto(record: TrainingFile) -> files_pb2.TrainingFile:
    return files_pb2.TrainingFile(
        file_id=record.file_id,
        filename=record.filename,
        purpose=record.purpose,
        bytes=record.size,
        created_at=timestamp(record.created_at),
    )


def _file_id(request: object) -> str:
    file_id = parsed(request).file_id
    if not _FILE_ID.match(file_id):
        raise invalid_argument("file_id", f"expected file- and 24 hex digits, got {file_id[:64]!r}")
    return file_id


class TrainingFileServicer:
    def __init__(self, store: TrainingFiles, limits: UploadLimits) -> None:
        self.store, self.limits = store, limits

    async def UploadTrainingFile(self, request, context: grpc.aio.ServicerContext):
        request = parsed(request)
        try:
            check_purpose(request.purpose)
            check_filename(request.filename)
            await check_content(request.filename, request.content, self.limits.max_bytes)
        except UploadRefused as refused:
            raise invalid_argument(refused.part, refused.message) from None
        try:
            record = await keep(self.store, self.limits, _owner(context), request.filename, request.content)
        except UploadRefused as refused:  # the owner keeps as many files as it may
            raise resource_exhausted(refused.message) from None
        except OutOfMemoryError:
            raise resource_exhausted(
                "no room for the file: Redis is at its memory cap; delete files you no longer need"
            ) from None
        return files_pb2.UploadTrainingFileResponse(file=file_proto(record))

    async def GetTrainingFile(self, request, context: grpc.aio.ServicerContext):
        file_id = _file_id(request)
        return files_pb2.GetTrainingFileResponse(file=file_proto(await self._get(file_id, context)))

    async def ListTrainingFiles(self, request, context: grpc.aio.ServicerContext):
        parsed(request)
        files = await self.store.list(_owner(context))
        return files_pb2.ListTrainingFilesResponse(files=[file_proto(f) for f in files])

    async def GetTrainingFileContent(self, request, context: grpc.aio.ServicerContext):
        file_id = _file_id(request)
        record = await self._get(file_id, context)
        content = await self.store.content(file_id, _owner(context))
        if content is None:  # deleted between the two reads
            raise not_found(f"no such file: {file_id}")
        return files_pb2.GetTrainingFileContentResponse(file=file_proto(record), content=content)

    async def DeleteTrainingFile(self, request, context: grpc.aio.ServicerContext):
        file_id = _file_id(request)
        record = await self._get(file_id, context)
        if not await self.store.delete(file_id, _owner(context)):
            raise not_found(f"no such file: {file_id}")
        return files_pb2.DeleteTrainingFileResponse(file=file_proto(record))

    async def _get(self, file_id: str, context: grpc.aio.ServicerContext) -> TrainingFile:
        record = await self.store.get(file_id, _owner(context))
        if record is None:
            raise not_found(f"no such file: {file_id}")
        return record


def _owner(context: grpc.aio.ServicerContext) -> str:
    return owner_of(current_caller(), peer_host(context.peer()))


def add_to_server(servicer: TrainingFileServicer, server: grpc.aio.Server) -> str:
    return add_tolerant_service(server, SERVICE, servicer, _METHODS, files_pb2)
