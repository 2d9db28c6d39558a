"""Stored responses of the Responses API (`store: true`, the default) in Redis: each one's record
(`expert:response:{id}`, JSON) holds the response as it was answered, the conversation that led to
it with its answer (chat messages: what `previous_response_id` continues, in a new session once the
response's own is gone), its session and turn (`session`, null for a plain job), and the API key
that made it. Records expire after EXPERT_JOB_TTL_SECONDS, as job records do. A response is only seen by
the key that made it (with auth off, by everyone): another key gets NOT_FOUND, as for an id that
never existed."""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from libs.auth.policy import current_caller, owning_key
from services.reception.http.response_sessions import ChainLink

PREFIX = "expert:response:"


def current_owner() -> str:
    """Whose responses the current call sees: its API key's id ("" with auth off)."""
    return owning_key(current_caller())


class ResponseStore:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis, self.ttl_s = redis, ttl_s

    async def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        owner: str,
        link: ChainLink | None = None,
    ) -> None:
        record = {
            "owner": owner,
            "response": response,
            "conversation": conversation,
            "session": link.as_json() if link is not None else None,
        }
        await self.redis.set(PREFIX + response["id"], json.dumps(record, ensure_ascii=False), ex=self.ttl_s)

    async def get(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The record of `response_id` if `owner` made it (None: none, or another's)."""
        raw = await self.redis.get(PREFIX + response_id)
        if raw is None:
            return None
        record = json.loads(raw)
        return record if record["owner"] == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete `owner`'s response `response_id`; whether there was one."""
        if await self.get(response_id, owner) is None:
            return False
        return bool(await self.redis.delete(PREFIX + response_id))
