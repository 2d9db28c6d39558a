"""Redis Streams as a work queue with consumer groups: priority reads over several streams,
reclaiming entries whose consumer died, a dead-letter stream for entries that keep failing, and
acknowledgement.

The contract is at-least-once: an entry stays pending until acknowledged, so an entry whose
consumer crashed is delivered again (by `reclaim`) and handlers must tolerate a repeat. All
functions take a `redis.asyncio.Redis` created with `decode_responses=False`: field values are
bytes, stream names, ids and field names are returned as str.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

FieldValue = bytes | str | int | float


@dataclass(frozen=True)
class Entry:
    """One stream entry delivered to this consumer; `deliveries` counts how many times the group
    has handed it out, this time included (1 for a first read)."""

    stream: str
    id: str
    fields: dict[str, bytes]
    deliveries: int


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _fields(raw: Mapping[bytes | str, Any]) -> dict[str, bytes]:
    return {
        _text(key): value if isinstance(value, bytes) else str(value).encode() for key, value in raw.items()
    }


def _first_entry(response: Any) -> tuple[bytes, dict] | None:
    # XREAD(GROUP) answers [[stream, [(id, fields), ...]], ...] over RESP2 and
    # {stream: [[(id, fields), ...]]} over RESP3.
    if not response:
        return None
    entries = next(iter(response.values()))[0] if isinstance(response, Mapping) else response[0][1]
    return entries[0] if entries else None


async def ensure_group(redis: Redis, stream: str, group: str) -> None:
    """Creates consumer group `group` on `stream` (and the stream if missing), reading from the start
    so entries added before the group existed are delivered too. An existing group is left as is."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as error:
        if "BUSYGROUP" not in str(error):
            raise


def missing_group(error: BaseException) -> bool:
    """Whether a Redis error says a consumer group (or its stream) is gone, as after a Redis restart
    without its data: the group's owner creates it again (`ensure_group`) and carries on."""
    return isinstance(error, ResponseError) and "NOGROUP" in str(error)


async def add(
    redis: Redis, stream: str, fields: Mapping[str, FieldValue], *, maxlen: int | None = None
) -> str:
    """Appends an entry and returns its id; with `maxlen`, old entries beyond about that many are
    trimmed (approximate trimming, which Redis does in whole nodes and so cheaply)."""
    entry_id = await redis.xadd(stream, dict(fields), maxlen=maxlen, approximate=True)
    return _text(entry_id)


async def add_many(
    redis: Redis, entries: Sequence[tuple[str, Mapping[str, FieldValue]]], *, maxlen: int | None = None
) -> list[str]:
    """`add` for several (stream, fields) entries in one round trip (a pipeline, not a transaction:
    each entry is added on its own); returns their ids in order."""
    async with redis.pipeline(transaction=False) as pipe:
        for stream, fields in entries:
            pipe.xadd(stream, dict(fields), maxlen=maxlen, approximate=True)
        return [_text(entry_id) for entry_id in await pipe.execute()]


async def ack(redis: Redis, stream: str, group: str, entry_id: str) -> bool:
    """Acknowledges an entry: it leaves the group's pending list and is never delivered again.
    Returns False when it was not pending (already acknowledged, or dead-lettered)."""
    return bool(await redis.xack(stream, group, entry_id))


# One round trip for a whole priority check, atomic so that no entry can arrive between the checks
# and the ids the wait starts from: the first stream (in KEYS order) with a new entry delivers it to
# the consumer (XREADGROUP COUNT 1); when none has one, the newest id of each stream comes back.
_READ_FIRST = """
for i, stream in ipairs(KEYS) do
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', stream, '>')
  if got and got[1] and #got[1][2] > 0 then
    local entry = got[1][2][1]
    return {'entry', stream, entry[1], entry[2]}
  end
end
local last = {}
for i, stream in ipairs(KEYS) do
  local newest = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  last[i] = newest[1] and newest[1][1] or '0-0'
end
return {'empty', last}
"""


async def _read_first(redis: Redis, streams: Sequence[str], group: str, consumer: str) -> Entry | list[str]:
    """The first new entry in `streams` order, or each stream's newest id when there is none."""
    # A registered script runs by its hash; its text goes to Redis only when Redis lacks it.
    reply = await redis.register_script(_READ_FIRST)(keys=list(streams), args=[group, consumer])
    if _text(reply[0]) == "empty":
        return [_text(i) for i in reply[1]]
    _, stream, entry_id, flat = reply
    fields = dict(zip(flat[0::2], flat[1::2], strict=True))
    return Entry(stream=_text(stream), id=_text(entry_id), fields=_fields(fields), deliveries=1)


async def read_next(
    redis: Redis, streams: Sequence[str], group: str, consumer: str, *, block_ms: int
) -> Entry | None:
    """The oldest new entry of the first stream in `streams` (highest priority first) that has one,
    delivered to `consumer` of `group` (which must exist on every stream). When all are empty,
    waits up to `block_ms` (0: not at all) for an entry on any of them and then checks again in
    order, so a higher-priority stream always wins. Returns None on timeout."""
    if not streams:
        raise ValueError("read_next needs at least one stream")
    deadline = time.monotonic() + block_ms / 1000
    while True:
        found = await _read_first(redis, streams, group, consumer)
        if isinstance(found, Entry):
            return found
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return None
        # A plain XREAD only waits: a blocking XREADGROUP would claim an entry of whichever stream
        # woke first, and a lower-priority entry claimed here could not be handed back. It starts
        # from the ids the check saw, so an entry added since then wakes it at once.
        await redis.xread(dict(zip(streams, found, strict=True)), count=1, block=left_ms)


async def reclaim(
    redis: Redis,
    stream: str,
    group: str,
    consumer: str,
    *,
    min_idle_ms: int,
    max_deliveries: int,
    dead_letter_stream: str,
    count: int = 10,
) -> list[Entry]:
    """Takes over up to `count` entries of `stream` that another consumer of `group` received but
    did not acknowledge within `min_idle_ms` (it died or hangs), oldest first. An entry already
    delivered `max_deliveries` times is not returned but moved to `dead_letter_stream`
    (`dead_letter`), so a poison entry stops circulating. XAUTOCLAIM hands each idle entry to one
    claimer only, so concurrent reclaimers never process or dead-letter the same entry twice."""
    if max_deliveries < 1:
        raise ValueError(f"max_deliveries must be at least 1, got {max_deliveries}")
    _cursor, claimed, _deleted = await redis.xautoclaim(
        stream, group, consumer, min_idle_ms, start_id="0-0", count=count
    )
    # Entries trimmed from the stream while pending come back without fields (or in `_deleted`).
    claimed = [(entry_id, fields) for entry_id, fields in claimed if fields is not None]
    if not claimed:
        return []
    # XAUTOCLAIM does not report delivery counts; XPENDING does (this claim included).
    async with redis.pipeline(transaction=False) as pipe:
        for entry_id, _ in claimed:
            pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        pending = await pipe.execute()
    entries: list[Entry] = []
    for (entry_id, fields), info in zip(claimed, pending, strict=True):
        if not info:
            # Acknowledged meanwhile by the slow consumer it was taken from: the work is done.
            continue
        entry = Entry(
            stream=stream, id=_text(entry_id), fields=_fields(fields), deliveries=info[0]["times_delivered"]
        )
        if entry.deliveries > max_deliveries:
            await dead_letter(redis, entry, group, dead_letter_stream, delivered=entry.deliveries - 1)
        else:
            entries.append(entry)
    return entries


async def dead_letter(
    redis: Redis,
    entry: Entry,
    group: str,
    dead_letter_stream: str,
    *,
    delivered: int,
    reason: str | None = None,
) -> None:
    """Move `entry` to `dead_letter_stream`: its fields plus `source_stream`, `source_id`,
    `deliveries` and, when given, `reason`; and acknowledge it, in one transaction."""
    fields: dict[str, FieldValue] = {
        **entry.fields,
        "source_stream": entry.stream,
        "source_id": entry.id,
        "deliveries": delivered,
    }
    if reason is not None:
        fields["reason"] = reason
    # One transaction: the entry is never both dead-lettered and still pending, nor neither.
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(dead_letter_stream, fields)
        pipe.xack(entry.stream, group, entry.id)
        await pipe.execute()
