"""The Responses API's stored responses (services/reception/http/response_store.py) in a real Redis:
a record is seen only by the API key that made it, expires with its TTL and can be deleted."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from libs.auth.policy import Caller, calling_as
from services.reception.http.response_store import PREFIX, ResponseStore, current_owner

CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_a_stored_response_is_its_owner_s_alone_and_can_be_deleted(clean_redis_url):
    async def scenario() -> None:
        redis = Redis.from_url(clean_redis_url)
        store = ResponseStore(redis, ttl_s=60)
        try:
            await store.put({"id": "resp_1", "output": []}, CONVERSATION, owner="key-a")
            record = await store.get("resp_1", "key-a")
            assert record["response"] == {"id": "resp_1", "output": []}
            assert record["conversation"] == CONVERSATION
            assert 0 < await redis.ttl(PREFIX + "resp_1") <= 60
            assert await store.get("resp_1", "key-b") is None  # another key: as if it did not exist
            assert await store.get("resp_1", "") is None
            assert await store.delete("resp_1", "key-b") is False
            assert await store.delete("resp_1", "key-a") is True
            assert await store.get("resp_1", "key-a") is None
            assert await store.delete("resp_1", "key-a") is False
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_the_owner_is_the_calling_key_or_nobody_with_auth_off():
    assert current_owner() == ""
    with calling_as(Caller(key_id="k1", scope="infer")):
        assert current_owner() == "k1"
    with calling_as(Caller(key_id=None, scope="internal")):
        assert current_owner() == ""
