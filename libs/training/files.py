"""Training files in Redis: what a user uploads to train on, kept apart from experts and jobs.

A file is one hash, `expert:training:file:{id}`: its owner (the API key id, or with auth off the
client's owner string), name, purpose, size, creation time and content. Only its owner sees it;
anyone else gets None, as for a file that does not exist, so ids reveal nothing. The owner's files
are a sorted set by creation time (`expert:training:files:{owner}`), for listing. Nothing expires:
a file lives until its owner deletes it (a training job reads it when it starts and again when it
resumes, so it must outlive the job's queueing).

Reception writes files (after checking the size cap and every line: libs.training.data); the
trainer reads a job's file by id with the job's owner, so a job can read no file but its owner's.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from libs.auth.policy import Caller

FILE_PREFIX = "expert:training:file:"
OWNER_PREFIX = "expert:training:files:"
ID_PREFIX = "file-"

# EXPERT_TRAINING_FILE_MAX_BYTES's default: the largest file reception accepts.
DEFAULT_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TrainingFile:
    """A stored file without its content."""

    file_id: str
    owner: str
    filename: str
    purpose: str
    size: int  # bytes
    created_at: float  # seconds since the epoch


def owner_of(caller: Caller | None, client_host: str) -> str:
    """Whose files a call sees: the API key it proved; else (auth off, or the internal token) its
    client's address, "client 10.0.0.5", as session limits count (libs.auth.limits.LimitOwner), so
    with auth off each client host has files of its own. gRPC gives `peer_host(context.peer())`."""
    if caller is not None and caller.key_id is not None:
        return caller.key_id
    return f"client {client_host or 'unknown'}"


def new_file_id() -> str:
    return ID_PREFIX + secrets.token_hex(12)


class TrainingFiles:
    """The stored training files of a Redis."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def put(self, owner: str, filename: str, purpose: str, content: bytes) -> TrainingFile:
        """Stores `content` as a new file of `owner` (the caller checked it)."""
        record = TrainingFile(new_file_id(), owner, filename, purpose, len(content), time.time())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                FILE_PREFIX + record.file_id,
                mapping={
                    "owner": owner,
                    "filename": filename,
                    "purpose": purpose,
                    "size": record.size,
                    "created_at": repr(record.created_at),
                    "content": content,
                },
            )
            pipe.zadd(OWNER_PREFIX + owner, {record.file_id: record.created_at})
            await pipe.execute()
        return record

    async def get(self, file_id: str, owner: str) -> TrainingFile | None:
        """`owner`'s file `file_id`, None when there is none (or it is someone else's)."""
        fields = await self.redis.hmget(
            FILE_PREFIX + file_id, ["owner", "filename", "purpose", "size", "created_at"]
        )
        if fields[0] is None or fields[0].decode() != owner:
            return None
        return TrainingFile(
            file_id,
            owner,
            fields[1].decode(),
            fields[2].decode(),
            int(fields[3]),
            float(fields[4]),
        )

    async def content(self, file_id: str, owner: str) -> bytes | None:
        """The content of `owner`'s file `file_id`, None when there is none."""
        stored_owner, content = await self.redis.hmget(FILE_PREFIX + file_id, ["owner", "content"])
        if stored_owner is None or stored_owner.decode() != owner:
            return None
        return content

    async def list(self, owner: str) -> list[TrainingFile]:
        """`owner`'s files, oldest first."""
        files = []
        for file_id in await self.redis.zrange(OWNER_PREFIX + owner, 0, -1):
            record = await self.get(file_id.decode(), owner)
            if record is not None:
                files.append(record)
        return files

    async def delete(self, file_id: str, owner: str) -> bool:
        """Deletes `owner`'s file `file_id`; False when there is none."""
        if await self.get(file_id, owner) is None:
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(FILE_PREFIX + file_id)
            pipe.zrem(OWNER_PREFIX + owner, file_id)
            await pipe.execute()
        return True
