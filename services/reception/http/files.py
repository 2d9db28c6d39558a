"""OpenAI's Files API for training data: POST /v1/files (a multipart form: `file`, `purpose`), GET
/v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content and DELETE /v1/files/{id}, over the
training files in Redis (libs.training.files), each its owner's alone: the API key's (owner_of).

Only purpose `fine-tune` is kept. An upload is checked whole before it is stored
(training_uploads): at most EXPERT_TRAINING_FILE_MAX_BYTES (the body is also bounded while it
arrives: body_guard.UploadRoute), UTF-8, and every line a training sample, so a stored file is one
a training job can read; a bad line is refused naming its number and field. The key checks
(Access.TRAIN on every route) are auth.py's."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from redis.exceptions import OutOfMemoryError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException

from libs.auth.policy import current_caller
from libs.training.files import TrainingFile, TrainingFiles, owner_of
from services.reception.http.body_guard import UploadRoute
from services.reception.http.errors import HttpError, ToHttpError
from services.reception.training_uploads import (
    UploadLimits,
    UploadRefused,
    check_content,
    check_filename,
    check_purpose,
    keep,
)

T = TypeVar("T")

FILES_PATH = "/v1/files"
FORM_FIELDS = ("file", "purpose")
# Room in an upload's body for the form around the file: its part headers and `purpose`.
FORM_OVERHEAD_BYTES = 64 * 1024
MAX_LIST_LIMIT = 10_000  # OpenAI's bound on `limit`, and its default
REDIS_FULL = "no room for the file: Redis is at its memory cap; delete files you no longer need"


@dataclass(frozen=True)
class FileUploads:
    """What the Files API works over: the store, and the bounds of what it keeps."""

    store: TrainingFiles
    limits: UploadLimits

    def upload_route(self) -> UploadRoute:
        return UploadRoute(self.limits.max_bytes + FORM_OVERHEAD_BYTES, "EXPERT_TRAINING_FILE_MAX_BYTES")


def file_object(record: TrainingFile) -> dict:
    """OpenAI's `file` object (a stored file is processed: it was checked before it was kept)."""
    return {
        "id": record.file_id,
        "object": "file",
        "bytes": record.size,
        "created_at": int(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,  # kept until deleted
    }


def add_files_routes(app: FastAPI, uploads: FileUploads, to_http_error: ToHttpError) -> None:
    """The Files API's routes on `app`; a failure to reach Redis is answered as `to_http_error` maps it."""
    store = uploads.store

    def owner(request: Request) -> str:
        return owner_of(current_caller(), request.client.host if request.client else "")

    async def stored(call: Awaitable[T]) -> T:
        try:
            return await call
        except Exception as error:
            raise store_error(error, to_http_error) from None

    @app.post(FILES_PATH)
    async def create_file(request: Request) -> dict:
        filename, content = await read_upload(request, uploads.limits.max_bytes)
        return file_object(await stored(keep(store, uploads.limits, owner(request), filename, content)))

    @app.get(FILES_PATH)
    async def list_files(request: Request) -> dict:
        query = ListQuery.of(request)
        return listing(await stored(store.list(owner(request))), query)

    @app.get(FILES_PATH + "/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> dict:
        return file_object(found(await stored(store.get(file_id, owner(request))), file_id))

    @app.get(FILES_PATH + "/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        content = found(await stored(store.content(file_id, owner(request))), file_id)
        return Response(content, media_type="application/jsonl")

    @app.delete(FILES_PATH + "/{file_id}")
    async def delete_file(request: Request, file_id: str) -> dict:
        found(await stored(store.delete(file_id, owner(request))) or None, file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def store_error(error: Exception, to_http_error: ToHttpError) -> HttpError:
    """The answer to a failed store call: Redis full (at its maxmemory with nothing it may evict,
    and files have no TTL) is 507, Redis down as `to_http_error` maps it."""
    if isinstance(error, UploadRefused):  # the owner keeps as many files as it may
        return refusal(error)
    if isinstance(error, OutOfMemoryError):
        return HttpError(507, REDIS_FULL, None, "insufficient_storage")
    return to_http_error(error, None)


def found(value: T | None, file_id: str) -> T:
    """`value`, or the 404 of a file that does not exist or is another owner's (alike: ids reveal nothing)."""
    if value is None:
        raise HttpError(404, f"no such file: {file_id[:64]}", "file_id", "file_not_found")
    return value


async def read_upload(request: Request, max_bytes: int) -> tuple[str, bytes]:
    """The uploaded file's name and content, checked (training_uploads): a multipart form of `file`
    and `purpose` (`fine-tune`), the file at most `max_bytes`, every line a training sample."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "multipart/form-data":
        raise HttpError(
            415,
            "upload the file as multipart/form-data, with the parts file and purpose",
            None,
            "unsupported_media_type",
        )
    try:
        # A few more fields than it takes, so that an unsupported one is refused by name below.
        form = await request.form(max_files=1, max_fields=8)
    except HTTPException as error:  # the form is malformed, or has more parts than it may
        raise HttpError(400, f"the multipart form cannot be read: {error.detail}", "file") from None
    try:
        upload = checked_form(form)
        filename = upload.filename or ""
        content = await upload.read(max_bytes + 1)
    finally:
        await form.close()
    try:
        check_filename(filename)
        await check_content(filename, content, max_bytes)
    except UploadRefused as refused:
        raise refusal(refused) from None
    return filename, content


def refusal(refused: UploadRefused) -> HttpError:
    """An upload's refusal as OpenAI's error: the file's name and content are the part `file`, and
    so is the file one too many."""
    param = "purpose" if refused.part == "purpose" else "file"
    return HttpError(413 if refused.too_large else 400, refused.message, param, refused.code)


def checked_form(form: FormData) -> UploadFile:
    """The form's file part, once the form holds only `file` (a file part) and `purpose`
    (`fine-tune`); a refusal names the field."""
    unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
    if unknown:
        name = unknown[0].split("[")[0]  # expires_after[anchor] -> expires_after
        message = f"{name} is not supported: files are kept until deleted"
        raise HttpError(400, message, name, "unsupported_parameter")
    purpose = form.get("purpose")
    try:
        check_purpose(purpose if isinstance(purpose, str) else "")
    except UploadRefused as refused:
        raise refusal(refused) from None
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        message = "file: missing, or not a file part with a filename"
        raise HttpError(400, message, "file", "missing_required_parameter")
    return upload


@dataclass(frozen=True)
class ListQuery:
    """GET /v1/files's query, as OpenAI's: `after` (a file id), `limit`, `order`, `purpose`."""

    after: str | None
    limit: int
    order: str
    purpose: str | None

    @classmethod
    def of(cls, request: Request) -> ListQuery:
        """The request's query, checked here rather than by FastAPI, whose refusal names no parameter."""
        params = request.query_params
        text = params.get("limit", str(MAX_LIST_LIMIT))
        digits = text.strip()
        # ASCII digits only, and few of them: int() refuses other digits and 4,300 of them.
        limit = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 6 else 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            message = f"limit: must be an integer from 1 to {MAX_LIST_LIMIT}, got {text[:32]!r}"
            raise HttpError(400, message, "limit")
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise HttpError(400, f"order: must be 'asc' or 'desc', got {order[:32]!r}", "order")
        return cls(params.get("after"), limit, order, params.get("purpose"))


def listing(files: list[TrainingFile], query: ListQuery) -> dict:
    """OpenAI's page of files: by creation time in `order`, those past the file `after`, at most `limit`."""
    after, limit, order, purpose = query.after, query.limit, query.order, query.purpose
    ordered = files if order == "asc" else files[::-1]
    if purpose is not None:
        ordered = [f for f in ordered if f.purpose == purpose]
    if after is not None:
        ids = [f.file_id for f in ordered]
        if after not in ids:
            raise HttpError(400, f"after: no such file: {after[:64]}", "after", "file_not_found")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": [file_object(f) for f in page],
        "first_id": page[0].file_id if page else None,
        "last_id": page[-1].file_id if page else None,
        "has_more": len(ordered) > limit,
    }
