"""libs.training.files against a real redis-server: a file is its owner's alone (another owner
neither reads, lists nor deletes it), its content comes back byte for byte, and deleting it
leaves nothing behind."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from libs.training.files import TrainingFiles

CONTENT = b'{"prompt": "2+2?", "completion": "4"}\n' * 3


def test_a_training_file_is_its_owners_alone_until_deleted(clean_redis_url):
    async def scenario():
        redis = Redis.from_url(clean_redis_url)
        try:
            files = TrainingFiles(redis)
            first = await files.put("key-a", "math.jsonl", "fine-tune", CONTENT)
            second = await files.put("key-a", "more.jsonl", "fine-tune", b"{}\n")
            assert first.file_id != second.file_id and first.size == len(CONTENT)
            assert await files.get(first.file_id, "key-a") == first
            assert await files.content(first.file_id, "key-a") == CONTENT
            assert [f.file_id for f in await files.list("key-a")] == [first.file_id, second.file_id]
            # Another owner sees nothing, and cannot delete it.
            assert await files.get(first.file_id, "key-b") is None
            assert await files.content(first.file_id, "key-b") is None
            assert await files.list("key-b") == []
            assert not await files.delete(first.file_id, "key-b")
            assert await files.delete(first.file_id, "key-a")
            assert not await files.delete(first.file_id, "key-a")
            assert await files.content(first.file_id, "key-a") is None
            assert [f.file_id for f in await files.list("key-a")] == [second.file_id]
            await files.delete(second.file_id, "key-a")
            assert await redis.keys("expert:training:*") == []
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_uploads_at_once_cannot_pass_an_owners_cap_together(clean_redis_url):
    async def scenario():
        redis = Redis.from_url(clean_redis_url)
        try:
            files = TrainingFiles(redis)
            puts = [files.put_within("key-a", f"{i}.jsonl", "fine-tune", CONTENT, 2) for i in range(6)]
            stored = [record for record in await asyncio.gather(*puts) if record is not None]
            assert len(stored) == 2 and await files.count("key-a") == 2
            assert await files.content(stored[0].file_id, "key-a") == CONTENT
            assert await files.put_within("key-b", "b.jsonl", "fine-tune", CONTENT, 2) is not None
            assert await files.put_within("key-a", "x.jsonl", "fine-tune", CONTENT, 0) is not None  # no cap
        finally:
            await redis.aclose()

    asyncio.run(scenario())
