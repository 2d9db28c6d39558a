"""Leases on the entries of Redis streams read by a consumer group: at-least-once delivery in which
an entry has one holder at a time, and a holder is never replaced because Redis went away.

A consumer working on an entry holds a lease on it (a key holding the consumer's name, with a TTL)
and renews it three times a lease; renewing also resets the entry's idle time. A queue names its
leases (`LeaseNaming`): reception's job queue has one per entry, the training queue one per job
(the entry's `job_id` field), so that a job queued twice still has one holder. Renewing and
claiming are each one script, so an entry has one holder at a time, and a holder that finds its
lease taken stops.

An entry is taken over only when its lease is gone, never for its idle time alone
(`OrphanGuard`): a Redis outage stops every renewal and lets every lease lapse (a lease restored
from the append-only file has expired by its own clock meanwhile), so a lapsed lease is only a
suspicion. A claimer takes an entry once its lease has stayed gone for a whole lease while it kept
looking at Redis; the living holders renew within a third of a lease once Redis answers, so they
keep theirs. A failed look, or more than a lease between two looks, forgets what was seen: either
may hide an outage that the holders could not renew through.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from libs.redis_streams import Entry

# KEYS: the lease, the stream; ARGV: group, consumer, lease ms, entry id
# -> 1 if the lease is the consumer's (taken or renewed, and the entry's idle time reset), 0 if
# another consumer holds it
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[4], 'JUSTID')
return 1
"""

# KEYS: the lease, the stream; ARGV: group, consumer, lease ms, entry id
# -> the entry's fields (flat) if claimed, nothing when someone holds its lease or it is gone
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {} end
local claimed = redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[4])
if #claimed == 0 or not claimed[1][2] then return {} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return claimed[1][2]
"""

# KEYS: the lease; ARGV: consumer -> 1 if it was the consumer's and is gone now
_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class LeaseNaming:
    """Which key an entry's lease is: `{prefix}{stream}:{entry id}` (one lease per entry), or with
    `field`, `{prefix}{the entry's value of that field}` (one lease for every entry that names the
    same thing, a training job say)."""

    prefix: str
    field: str | None = None

    def key(self, stream: str, entry_id: str, fields: Mapping[str, bytes] | None = None) -> str | None:
        """The lease's key; None when the naming field is missing (the entry cannot be leased)."""
        if self.field is None:
            return f"{self.prefix}{stream}:{entry_id}"
        value = (fields or {}).get(self.field)
        return self.prefix + _text(value) if value else None


@dataclass(frozen=True)
class Unleased:
    """A pending entry whose lease is gone."""

    entry_id: str
    deliveries: int  # times the group handed it out so far
    lease: str  # the key it would be claimed under


class StreamLeases:
    """The lease operations on the entries of a consumer group (a client with decode_responses=False)."""

    def __init__(self, redis: Redis, group: str, naming: LeaseNaming, lease_ms: int) -> None:
        self.redis = redis
        self.group = group
        self.naming = naming
        self.lease_ms = lease_ms  # how long a lease lasts unless renewed
        self._renew = redis.register_script(_RENEW)
        self._claim = redis.register_script(_CLAIM)
        self._let_go = redis.register_script(_LET_GO)

    async def renew(self, lease: str, stream: str, entry_id: str, consumer: str) -> bool:
        """Take or extend the consumer's lease on the entry; False when another consumer holds it
        (it took the entry over while this one could not renew)."""
        reply = await self._renew(keys=[lease, stream], args=[self.group, consumer, self.lease_ms, entry_id])
        return reply == 1

    async def claim(self, lease: str, stream: str, entry_id: str, consumer: str) -> dict[str, bytes] | None:
        """Take the entry and its lease for the consumer, unless someone holds the lease (or the
        entry is gone); returns its fields."""
        flat = await self._claim(keys=[lease, stream], args=[self.group, consumer, self.lease_ms, entry_id])
        if not flat:
            return None
        return {_text(k): v for k, v in zip(flat[0::2], flat[1::2], strict=True)}

    async def let_go(self, lease: str, consumer: str) -> bool:
        """Drop the consumer's lease (it stops working on the entry unfinished), so another consumer
        may take the entry without waiting for the lease to lapse; False when it was not its own."""
        return await self._let_go(keys=[lease], args=[consumer]) == 1

    async def unleased(self, stream: str, min_idle_ms: int, count: int = 100) -> list[Unleased]:
        """The pending entries of `stream` idle for `min_idle_ms` or more whose lease is gone,
        oldest first. An entry whose lease cannot be named (gone from the stream, or without the
        naming field) is left out."""
        pending = await self.redis.xpending_range(
            stream, self.group, min="-", max="+", count=count, idle=min_idle_ms
        )
        if not pending:
            return []
        ids = [_text(p["message_id"]) for p in pending]
        if self.naming.field is None:
            leases = [self.naming.key(stream, entry_id) for entry_id in ids]
        else:  # the lease is named by a field: read the entries
            leases = await self._leases_by_field(stream, ids)
        named = [
            (entry_id, p, lease) for entry_id, p, lease in zip(ids, pending, leases, strict=True) if lease
        ]
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, _, lease in named:
                pipe.exists(lease)
            held = await pipe.execute()
        return [
            Unleased(entry_id, int(p["times_delivered"]), lease)
            for (entry_id, p, lease), is_held in zip(named, held, strict=True)
            if not is_held
        ]

    async def _leases_by_field(self, stream: str, ids: list[str]) -> list[str | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xrange(stream, min=entry_id, max=entry_id, count=1)
            found = await pipe.execute()
        return [
            self.naming.key(stream, entry_id, {_text(k): v for k, v in rows[0][1].items()}) if rows else None
            for entry_id, rows in zip(ids, found, strict=True)
        ]


class OrphanGuard:
    """Which pending entries a consumer may take over: those whose holder is gone (module docstring).

    It remembers since when it has seen each entry without its lease; an entry is claimed once that
    is a whole lease, unless it is one of the consumer's own (`own`). Entries seen leased again
    start over, and so does everything after a failed look or a pause of over a lease between looks.
    """

    def __init__(
        self,
        leases: StreamLeases,
        streams: Sequence[str],
        consumer: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.leases = leases
        self.streams = list(streams)
        self.consumer = consumer
        self.clock = clock
        self._gone_since: dict[tuple[str, str], float] = {}  # (stream, entry id) -> first seen unleased
        self._last_look: float | None = None

    def forget(self) -> None:
        """A look failed (Redis unreachable): what was seen may be an outage, not a dead holder."""
        self._gone_since.clear()
        self._last_look = None

    async def orphans(self, own: Collection[tuple[str, str]] = ()) -> list[Entry]:
        """Claim the entries whose lease has been gone for a whole lease, but for `own` (the
        (stream, entry id) this consumer is working on); returns them, claimed, with their leases."""
        now, lease_s = self.clock(), self.leases.lease_ms / 1000
        # Unwatched for over a lease (in whole milliseconds, as leases are), Redis may have been
        # away long enough meanwhile for a living holder's lease to lapse.
        if self._last_look is not None and round((now - self._last_look) * 1000) > self.leases.lease_ms:
            self.forget()
        try:
            claimed = await self._claim_orphans(own, now, lease_s)
        except BaseException:
            self.forget()
            raise
        self._last_look = now
        return claimed

    async def _claim_orphans(
        self, own: Collection[tuple[str, str]], now: float, lease_s: float
    ) -> list[Entry]:
        seen: dict[tuple[str, str], float] = {}
        claimed: list[Entry] = []
        for stream in self.streams:
            for found in await self.leases.unleased(stream, self.leases.lease_ms):
                key = (stream, found.entry_id)
                if key in own:
                    continue
                since = seen[key] = self._gone_since.get(key, now)
                if now - since < lease_s:
                    continue
                fields = await self.leases.claim(found.lease, stream, found.entry_id, self.consumer)
                del seen[key]
                if fields is not None:
                    claimed.append(Entry(stream, found.entry_id, fields, found.deliveries + 1))
        self._gone_since = seen  # entries no longer unleased start over
        return claimed
