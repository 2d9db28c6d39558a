"""Which queue entries a dispatcher may take over: those whose holder is gone.

A holder renews its entry's lease while the job runs (`JobQueue.renew`). A lease can lapse without
its holder dying: Redis down or stalled for longer than a lease stops every renewal, and a lease
restored from Redis's append-only file has expired by its own clock meanwhile. So a lapsed lease is
only a suspicion: an entry is taken once its lease has stayed gone for a whole lease while this
dispatcher could see Redis (the living holder renews within a third of a lease once Redis answers),
and never when it is one of this dispatcher's own running jobs. Any failed look forgets what was
seen, since it may be an outage the holders could not renew through.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from libs.redis_streams import Entry
from services.reception.queue import STREAMS, JobQueue


class Reclaimer:
    def __init__(self, queue: JobQueue, consumer: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.consumer = consumer
        self.clock = clock
        self._gone_since: dict[tuple[str, str], float] = {}  # (stream, entry id) -> first seen unleased

    def forget(self) -> None:
        """A look failed (Redis unreachable): what was seen may be an outage, not a dead holder."""
        self._gone_since.clear()

    async def orphans(self, own: Collection[tuple[str, str]]) -> list[Entry]:
        """Claim the entries whose lease has been gone for a whole lease, but for `own` (the
        (stream, entry id) this dispatcher is handling); returns them, claimed, with their leases."""
        try:
            return await self._claim_orphans(own)
        except BaseException:
            self.forget()
            raise

    async def _claim_orphans(self, own: Collection[tuple[str, str]]) -> list[Entry]:
        now, lease_s = self.clock(), self.queue.lease_ms / 1000
        seen: dict[tuple[str, str], float] = {}
        claimed: list[Entry] = []
        for name in STREAMS:
            for entry_id, delivered in await self.queue.unleased(name, self.queue.lease_ms):
                key = (name, entry_id)
                if key in own:
                    continue
                since = seen[key] = self._gone_since.get(key, now)
                if now - since < lease_s:
                    continue
                fields = await self.queue.claim(name, entry_id, self.consumer)
                del seen[key]
                if fields is not None:
                    claimed.append(Entry(stream=name, id=entry_id, fields=fields, deliveries=delivered + 1))
        self._gone_since = seen  # entries no longer unleased start over
        return claimed
