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
# EXPERT_TRAINING_FILES_PER_OWNER's default: the files one owner may keep at once.
DEFAULT_MAX_PER_OWNER = 20


@dataclass(frozen=True)
class TrainingFile:
    """A stored file without its content."""

    file_id: str
    owner: str
    filename: str
    purpose: str
    size: int  # bytes
    created_at: float  # seconds since the epoch


# KEYS: the new file's hash, its owner's set; ARGV: the cap (0: none), created_at, the file's id,
# then its owner, filename, purpose, size and content -> 1 stored, 0 the owner is at the cap.
_PUT_WITHIN = """
local cap = tonumber(ARGV[1])
if cap > 0 and redis.call('ZCARD', KEYS[2]) >= cap then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[4], 'filename', ARGV[5], 'purpose', ARGV[6],
  'size', ARGV[7], 'created_at', ARGV[2], 'content', ARGV[8])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


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

    async def put_within(
        self, owner: str, filename: str, purpose: str, content: bytes, max_files: int
    ) -> TrainingFile | None:
        """`put`, unless `owner` already keeps `max_files` files (0: no cap): then None, nothing
        written. One script, so that uploads at once cannot pass the cap together."""
        record = TrainingFile(new_file_id(), owner, filename, purpose, len(content), time.time())
        stored = await self.redis.eval(
            _PUT_WITHIN,
            2,
            FILE_PREFIX + record.file_id,
            OWNER_PREFIX + owner,
            max_files,
            repr(record.created_at),
            record.file_id,
            owner,
            filename,
            purpose,
            record.size,
            content,
        )
        return record if stored else None

    async def count(self, owner: str) -> int:
        """How many files `owner` keeps."""
        return await self.redis.zcard(OWNER_PREFIX + owner)

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
