"""What a training file must be to be kept, whichever API it came through (the HTTP front's
/v1/files, gRPC's TrainingFileService): purpose `fine-tune`, a filename, at most
EXPERT_TRAINING_FILE_MAX_BYTES, UTF-8 and every line a training sample (libs.training.data). A
refusal is an UploadRefused naming the part at fault; each API answers it in its own shape. A file
is then kept unless its owner already keeps EXPERT_TRAINING_FILES_PER_OWNER files (`keep`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from libs.training.data import DataError, parse_bytes
from libs.training.files import TrainingFile, TrainingFiles

PURPOSE = "fine-tune"  # the one purpose kept: training data
MAX_FILENAME_CHARS = 255


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int  # EXPERT_TRAINING_FILE_MAX_BYTES: the largest file
    max_per_owner: int  # EXPERT_TRAINING_FILES_PER_OWNER: the files one owner keeps at once (0: no cap)


@dataclass
class UploadRefused(Exception):
    """An upload that is not kept: `part` is "filename", "purpose", "content" or "owner" (who keeps
    too many files); `code` is the OpenAI-style code of the refusal; `too_large` marks a content
    over the cap."""

    part: str
    message: str
    code: str
    too_large: bool = False

    def __str__(self) -> str:
        return self.message


def check_purpose(purpose: str) -> None:
    if not purpose:
        message = "purpose: missing (it must be 'fine-tune')"
        raise UploadRefused("purpose", message, "missing_required_parameter")
    if purpose != PURPOSE:
        message = f"purpose {purpose!r} is not supported: only 'fine-tune' files (training data) are kept"
        raise UploadRefused("purpose", message, "invalid_purpose")


def check_filename(filename: str) -> None:
    if not filename.strip() or len(filename) > MAX_FILENAME_CHARS:
        message = f"the filename must be 1 to {MAX_FILENAME_CHARS} characters"
        raise UploadRefused("filename", message, "invalid_filename")


async def check_content(filename: str, content: bytes, max_bytes: int) -> None:
    """`content` is at most `max_bytes` and every line of it a training sample; a bad line is refused
    naming the file, the line and the field."""
    if len(content) > max_bytes:
        message = f"the file is larger than the limit of {max_bytes} bytes (EXPERT_TRAINING_FILE_MAX_BYTES)"
        raise UploadRefused("content", message, "file_too_large", too_large=True)
    try:
        # Off the event loop: a large file's lines take a while to parse.
        await asyncio.to_thread(parse_bytes, content, filename)
    except DataError as error:
        raise UploadRefused("content", f"the training file is not valid: {error}", "invalid_file") from None


async def keep(
    store: TrainingFiles, limits: UploadLimits, owner: str, filename: str, content: bytes
) -> TrainingFile:
    """Keeps a checked file for `owner`, unless `owner` keeps as many files as it may."""
    record = await store.put_within(owner, filename, PURPOSE, content, limits.max_per_owner)
    if record is None:
        message = (
            f"{owner} keeps {limits.max_per_owner} training files, the most "
            "EXPERT_TRAINING_FILES_PER_OWNER allows: delete one to upload another"
        )
        raise UploadRefused("owner", message, "too_many_files")
    return record
