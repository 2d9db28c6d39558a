"""The training queue: one Redis stream (`expert:training:queue`) of job ids, read by the trainers'
consumer group, with at-least-once delivery.

A trainer that takes an entry holds its job's lease (`expert:training:lease:{job id}`: the
trainer's name with a TTL) and renews it while it trains; renewing also resets the entry's idle
time. An entry whose job's lease is gone and that has been idle a whole lease (its trainer died, or
hangs) is claimed by another trainer, which resumes the job from its last checkpoint. Renewing and
claiming are each one script, so a job has one trainer at a time, and a trainer that finds its
lease taken stops. An entry for a job another trainer holds (a job queued twice by a resume) is
dropped. Entries are acknowledged and deleted once their job is final (or handed back).
"""

from __future__ import annotations

from redis.asyncio import Redis

from libs.redis_streams import Entry, dead_letter, ensure_group, read_next

QUEUE_STREAM = "expert:training:queue"
GROUP = "trainers"
DEAD_LETTER = "expert:training:dead"
LEASE_PREFIX = "expert:training:lease:"


def lease_key(job_id: str) -> str:
    return LEASE_PREFIX + job_id


# KEYS: the lease, the stream; ARGV: group, consumer, lease ms, entry id
# -> 1 when the lease is the consumer's (taken or renewed, the entry's idle time reset), 0 otherwise
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[4], 'JUSTID')
return 1
"""

# KEYS: the stream; ARGV: group, consumer, lease ms, entry id, min idle ms, lease prefix
# -> the entry's fields (flat) when claimed with its job's lease; nothing when the job is held, the
# entry is gone or was not idle long enough
_CLAIM = """
local entry = redis.call('XRANGE', KEYS[1], ARGV[4], ARGV[4])
if #entry == 0 then return {} end
local fields = entry[1][2]
local job = nil
for i = 1, #fields, 2 do if fields[i] == 'job_id' then job = fields[i + 1] end end
if not job then return {} end
local lease = ARGV[6] .. job
if redis.call('EXISTS', lease) == 1 then return {} end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[5], ARGV[4])
if #claimed == 0 then return {} end
redis.call('SET', lease, ARGV[2], 'PX', ARGV[3])
return fields
"""

# KEYS: the lease; ARGV: consumer -> 1 when it was the consumer's and is gone now
_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class TrainingQueue:
    def __init__(self, redis: Redis, consumer: str, lease_ms: int = 30_000) -> None:
        self.redis = redis
        self.consumer = consumer
        self.lease_ms = lease_ms
        self._hold = redis.register_script(_HOLD)
        self._claim = redis.register_script(_CLAIM)
        self._let_go = redis.register_script(_LET_GO)

    async def setup(self) -> None:
        await ensure_group(self.redis, QUEUE_STREAM, GROUP)

    async def next(self, block_ms: int) -> Entry | None:
        """A new entry, waiting up to `block_ms`; None when none came."""
        return await read_next(self.redis, [QUEUE_STREAM], GROUP, self.consumer, block_ms=block_ms)

    async def hold(self, entry: Entry) -> bool:
        """Take or renew the lease of the entry's job; False when another trainer holds it."""
        reply = await self._hold(
            keys=[lease_key(job_id_of(entry)), QUEUE_STREAM],
            args=[GROUP, self.consumer, self.lease_ms, entry.id],
        )
        return reply == 1

    async def orphans(self) -> list[Entry]:
        """Claim the entries idle for a whole lease whose job nobody holds (its trainer is gone)."""
        pending = await self.redis.xpending_range(
            QUEUE_STREAM, GROUP, min="-", max="+", count=20, idle=self.lease_ms
        )
        claimed = []
        for info in pending:
            entry_id = _text(info["message_id"])
            flat = await self._claim(
                keys=[QUEUE_STREAM],
                args=[GROUP, self.consumer, self.lease_ms, entry_id, self.lease_ms, LEASE_PREFIX],
            )
            if flat:
                fields = {_text(k): v for k, v in zip(flat[0::2], flat[1::2], strict=True)}
                deliveries = int(info["times_delivered"]) + 1
                claimed.append(Entry(QUEUE_STREAM, entry_id, fields, deliveries))
        return claimed

    async def done(self, entry: Entry) -> None:
        """Acknowledge and delete an entry, and drop its job's lease if it is this trainer's."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(QUEUE_STREAM, GROUP, entry.id)
            pipe.xdel(QUEUE_STREAM, entry.id)
            await pipe.execute()
        await self.let_go(entry)

    async def let_go(self, entry: Entry) -> None:
        """Drop this trainer's lease of the entry's job (stopping unfinished), so another trainer may
        take the entry once it has been idle a whole lease."""
        await self._let_go(keys=[lease_key(job_id_of(entry))], args=[self.consumer])

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        await dead_letter(self.redis, entry, GROUP, DEAD_LETTER, delivered=entry.deliveries, reason=reason)
        await self.redis.xdel(QUEUE_STREAM, entry.id)


def job_id_of(entry: Entry) -> str:
    return entry.fields.get("job_id", b"").decode()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
