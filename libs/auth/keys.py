"""API keys and where they live: Redis, as SHA-256 hashes, never in clear.

A key reads `esk_<key_id>_<secret>`: `key_id` (12 hex digits) names it in listings and audit lines,
`secret` (`secrets.token_urlsafe(32)`, 256 bits) makes it unguessable. Per key, the hash
`expert:apikey:<key_id>` holds its name, the SHA-256 of the whole key, its scope, its limits and
when it was created and revoked; the set `expert:apikeys` lists the ids. A revoked key stays listed
(with revoked_at) and is refused from the next call on: nothing caches a key's record.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis

PREFIX = "esk_"
KEY_PREFIX = "expert:apikey:"
KEY_IDS = "expert:apikeys"
INFER, ADMIN, TRAIN = "infer", "admin", "train"
SCOPES = (INFER, ADMIN, TRAIN)
# KEYS: the key's hash, the set of ids; ARGV: id, then field, value pairs -> 1, or 0 if the id is taken
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
# KEYS: the key's hash; ARGV: now -> 1 if revoked now, 0 if it was already, -1 if there is no such key
_REVOKE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'revoked_at') ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'revoked_at', ARGV[1])
return 1
"""
_KEY = re.compile(r"^esk_(?P<key_id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_-]{16,128})$")


def key_hash(key_id: str) -> str:
    """The Redis hash that holds key `key_id`'s record."""
    return KEY_PREFIX + key_id


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key_id(key: str) -> str | None:
    """The id inside a key that has the shape of one; None for anything else."""
    match = _KEY.match(key)
    return match["key_id"] if match else None


@dataclass(frozen=True)
class KeyRecord:
    """A key as stored, without the key itself or its hash."""

    key_id: str
    name: str
    scope: str  # "infer", "train" or "admin" (train and admin include infer; admin includes train)
    rate_limit: int  # requests per minute; 0: no limit
    token_limit: int  # generated tokens per minute; 0: no limit
    created_at: float
    revoked_at: float | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def _record(key_id: str, fields: dict[bytes, bytes]) -> KeyRecord:
    revoked = fields.get(b"revoked_at")
    return KeyRecord(
        key_id=key_id,
        name=fields[b"name"].decode(),
        scope=fields[b"scope"].decode(),
        rate_limit=int(fields.get(b"rate_limit") or 0),
        token_limit=int(fields.get(b"token_limit") or 0),
        created_at=float(fields[b"created_at"]),
        revoked_at=float(revoked) if revoked else None,
    )


class KeyStore:
    """Creates, verifies, lists and revokes API keys in Redis. The caller validates the arguments
    (the KeyService servicer names the fields at fault)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._create = redis.register_script(_CREATE)
        self._revoke = redis.register_script(_REVOKE)

    async def create(self, name: str, scope: str, rate_limit: int, token_limit: int) -> tuple[KeyRecord, str]:
        """A new key: its record and the key itself, which only the caller ever sees."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        while True:
            key_id = secrets.token_hex(6)
            key = f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
            now = time.time()
            fields = {
                "name": name,
                "sha256": digest(key),
                "scope": scope,
                "rate_limit": rate_limit,
                "token_limit": token_limit,
                "created_at": repr(now),
                "revoked_at": "",
            }
            pairs = [item for pair in fields.items() for item in pair]
            # One script: a key is never listed half-written, and an id already taken (a 1 in 2^48
            # chance) is drawn again, never overwritten.
            if await self._create(keys=[key_hash(key_id), KEY_IDS], args=[key_id, *pairs]):
                break
        return KeyRecord(key_id, name, scope, rate_limit, token_limit, now, None), key

    async def verify(self, key: str) -> KeyRecord | None:
        """The record of `key` (revoked or not: check `revoked`), or None when no stored key
        matches it. The hashes are compared in constant time."""
        key_id = parse_key_id(key)
        if key_id is None:
            return None
        fields = await self.redis.hgetall(key_hash(key_id))
        stored = fields.get(b"sha256")
        if stored is None or not hmac.compare_digest(stored.decode(), digest(key)):
            return None
        return _record(key_id, fields)

    async def get(self, key_id: str) -> KeyRecord | None:
        fields = await self.redis.hgetall(key_hash(key_id))
        return _record(key_id, fields) if fields.get(b"sha256") else None

    async def list(self) -> list[KeyRecord]:
        """Every key, oldest first."""
        ids = sorted(raw.decode() for raw in await self.redis.smembers(KEY_IDS))
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id in ids:
                pipe.hgetall(key_hash(key_id))
            replies = await pipe.execute()
        records = [_record(key_id, fields) for key_id, fields in zip(ids, replies, strict=True) if fields]
        return sorted(records, key=lambda record: record.created_at)

    async def revoke(self, key_id: str) -> KeyRecord | None:
        """Revoke the key (at once: the next call with it is refused); its record as revoked, or
        None when there is no such key. Revoking a revoked key keeps its first revocation time."""
        if await self._revoke(keys=[key_hash(key_id)], args=[repr(time.time())]) == -1:
            return None
        return await self.get(key_id)
