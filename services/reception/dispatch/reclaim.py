"""Which queue entries a dispatcher may take over: those whose holder is gone.

A holder renews its entry's lease while the job runs (`JobQueue.renew`). A lease can lapse without
its holder dying: Redis down or stalled for longer than a lease stops every renewal, and a lease
restored from Redis's append-only file has expired by its own clock meanwhile. So a lapsed lease is
only a suspicion: an entry is taken once its lease has stayed gone for a whole lease while this
dispatcher could see Redis (the living holder renews within a third of a lease once Redis answers),
and never when it is one of this dispatcher's own running jobs. Any failed look, or a pause of
over a lease between two looks (the dispatcher looks every quarter lease), forgets what was seen,
since either may hide an outage the holders could not renew through. The rule is
libs/stream_lease.py's `OrphanGuard`, which the trainers follow too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from libs.stream_lease import OrphanGuard
from services.reception.queue import STREAMS, JobQueue


class Reclaimer(OrphanGuard):
    """The guard over the job queue's streams, for one dispatcher."""

    def __init__(self, queue: JobQueue, consumer: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(queue.leases, STREAMS, consumer, clock)
        self.queue = queue
