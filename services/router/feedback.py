"""Feedback learning: the router reads postproc's feedback stream and updates each expert's
success rate and use count in the index, so the next Plan scores with what the last jobs taught.

The routers read `expert:feedback` as one consumer group, so each record counts once however many
routers run; a record is acknowledged after it was applied, and the records of a router that died
are taken over by another (at least once: a record applied just before a crash may count twice).
A job succeeded for an expert when it completed and its output passed validation. The update of an
expert's statistics is atomic in Redis (`stats.py`), so routers applying records for the same expert
at the same moment never lose one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid

from redis.asyncio import Redis

from libs.feedback import FEEDBACK_STREAM, read_record
from libs.logging import get_logger
from libs.redis_streams import Entry, ack, ensure_group, missing_group, read_next, reclaim
from services.router.index import ExpertIndex

log = get_logger(__name__)

GROUP = "router-feedback"
DEAD_LETTER = "expert:feedback:dead"


class FeedbackLearner:
    def __init__(self, redis: Redis, index: ExpertIndex, alpha: float, reclaim_idle_ms: int = 30_000) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.redis = redis
        self.index = index
        self.alpha = alpha
        self.reclaim_idle_ms = reclaim_idle_ms
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.applied = 0  # records applied by this router

    async def restore(self) -> None:
        """Create the group again (after Redis lost its data); harmless when it exists."""
        await ensure_group(self.redis, FEEDBACK_STREAM, GROUP)

    async def run(self) -> None:
        """Apply feedback until cancelled."""
        await self.restore()
        while True:
            try:
                for entry in await reclaim(
                    self.redis,
                    FEEDBACK_STREAM,
                    GROUP,
                    self.consumer,
                    min_idle_ms=self.reclaim_idle_ms,
                    max_deliveries=5,
                    dead_letter_stream=DEAD_LETTER,
                ):
                    await self._apply(entry)
                entry = await read_next(self.redis, [FEEDBACK_STREAM], GROUP, self.consumer, block_ms=1000)
                if entry is not None:
                    await self._apply(entry)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis or Qdrant hiccups: keep learning once they are back
                if missing_group(error):  # Redis lost its data: the group goes again
                    log.warning("the feedback group is gone: creating it again")
                    with contextlib.suppress(Exception):
                        await ensure_group(self.redis, FEEDBACK_STREAM, GROUP)
                    continue
                log.exception("applying feedback failed")
                await asyncio.sleep(1.0)

    async def _apply(self, entry: Entry) -> None:
        record = read_record(entry.fields)
        if record is None:
            log.warning("feedback entry without a record: skipped", entry=entry.id)
        else:
            success = record.success and record.validation_passed
            # Qdrant and Redis calls: on a thread, off the event loop.
            await asyncio.to_thread(self._record, list(record.experts), success)
            self.applied += 1
        await ack(self.redis, FEEDBACK_STREAM, GROUP, entry.id)

    def _record(self, names: list[str], success: bool) -> None:
        for name in names:
            self.index.record_outcome(name, success, self.alpha)
