"""The dispatcher: pulls jobs from the priority queue and runs each in its own task.

It takes a job whenever preparation reports a free engine slot that no job it already took is about
to fill (backpressure), most important priority first, so the jobs in progress follow the fleet's
free slots (up to `max_jobs`, a memory bound per reception). The queue entry is acknowledged only
once the job reached a final state; while it runs, the dispatcher renews its lease on the entry
(queue.py), so only the entries of a dispatcher that died, or that gave a job up, lose their lease:
another dispatcher reclaims them (`reclaim.py`) and runs the job again. A dispatcher that finds the
lease of a job it runs taken by another stops its run (the other one runs it). A job delivered
`max_deliveries` times is moved to the dead-letter stream and marked FAILED with the reason.
Cancellations arrive on a Redis channel; the task running the job stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.gen.expert.v1 import common_pb2
from libs.logging import bind_context, get_logger
from libs.redis_streams import Entry, dead_letter, missing_group, read_next
from services.reception.capacity import Capacity
from services.reception.dispatch.pipeline import Pipeline
from services.reception.dispatch.reclaim import Reclaimer
from services.reception.dispatch.run import JobRun
from services.reception.jobs import CANCEL_CHANNEL, JobStore
from services.reception.metrics import ReceptionMetrics
from services.reception.queue import DEAD_LETTER, GROUP, STREAMS, JobQueue

log = get_logger(__name__)

# While the fleet has no free slot, how long the taker waits before asking preparation again.
FULL_WAIT_MIN_S = 0.05
FULL_WAIT_MAX_S = 0.4


@dataclass
class _Handling:
    """Where the handling of one queue entry stands, for its cleanup."""

    counted: bool = True  # still counted in `_unplaced`
    final: bool = False  # the job reached a final state: its entry is acknowledged


@dataclass(frozen=True)
class DispatchSettings:
    max_jobs: int  # jobs in progress at once in this reception, whatever the fleet's free slots
    reclaim_idle_ms: int  # the lease on each running job (the JobQueue is built with it)
    max_deliveries: int
    default_timeout_s: float | None
    # How long past its deadline a job in progress is left to its dispatcher before it is swept.
    sweep_grace_s: float = 30.0


class Dispatcher:
    def __init__(
        self,
        redis: Redis,
        jobs: JobStore,
        queue: JobQueue,
        pipeline: Pipeline,
        capacity: Capacity,
        settings: DispatchSettings,
        metrics: ReceptionMetrics,
    ) -> None:
        self.redis = redis
        self.jobs = jobs
        self.queue = queue
        self.pipeline = pipeline
        self.capacity = capacity
        self.settings = settings
        self.metrics = metrics
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._reclaim = Reclaimer(queue, self.consumer)
        self._own: set[tuple[str, str]] = set()  # (stream, entry id) of the entries being handled
        self._cancels: dict[str, asyncio.Event] = {}  # of the jobs this dispatcher runs
        self._unplaced = 0  # jobs taken but not yet placed: they will use slots preparation still shows free
        self._tasks: list[asyncio.Task] = []
        self._jobs: set[asyncio.Task] = set()  # one per job being handled
        self._job_ended = asyncio.Event()  # a slot may have come back: the taker looks again at once
        self._full_wait_s = FULL_WAIT_MIN_S  # how long the taker waits before it asks again (_take)
        self._draining = False
        self._active = 0  # jobs being handled
        self.on_finished: Callable[[float], None] | None = None  # told each finished job's duration

    async def start(self) -> None:
        await self.queue.setup()
        self._tasks = [
            asyncio.create_task(self._taker()),
            asyncio.create_task(self._reclaimer()),
            asyncio.create_task(self._cancellations()),
            asyncio.create_task(self._expiry()),
            asyncio.create_task(self._queue_gauge()),
        ]
        log.info("dispatcher started", consumer=self.consumer, max_jobs=self.settings.max_jobs)

    async def drain(self, seconds: float) -> None:
        """Stop taking jobs and give the running ones `seconds` to end; stop() then hands back
        those still running. Such a job is stopped where it is: its saga gives its slot back as it
        unwinds, and its queue entry stays unacknowledged, so another dispatcher reclaims it and
        runs it again."""
        self._draining = True
        deadline = time.monotonic() + seconds
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._active:
            log.warning("handing back the jobs still running", jobs=self._active)

    async def stop(self) -> None:
        """Stop now: the jobs in flight are left to be reclaimed by another dispatcher."""
        self._draining = True
        tasks = [*self._tasks, *self._jobs]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _taker(self) -> None:
        """Take jobs one after another, each handled in its own task, while slots are free."""
        while not self._draining:
            try:
                entry = await self._take()
                if entry is not None:
                    self._spawn(self._handle(entry, reserved=True))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis hiccups and the like: keep taking
                if missing_group(error):
                    await self._restore_queue()
                    continue
                log.exception("dispatcher error while taking a job")
                await asyncio.sleep(0.5)

    def _spawn(self, handling) -> None:
        task = asyncio.create_task(handling)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def _restore_queue(self) -> None:
        log.warning("the queue's consumer groups are gone (Redis lost its data): creating them again")
        try:
            await self.queue.setup()
        except Exception:
            log.exception("creating the queue's consumer groups failed")
            await asyncio.sleep(0.5)

    async def _take(self) -> Entry | None:
        """The next job, reserved against a free slot; None if no slot is free or no job came.

        Without a free slot it waits for one of its own jobs to end (at once), or for the next look
        at preparation's answer, where only the slots other receptions give back show: 50 ms after
        the fleet filled, doubling to 400 ms while it stays full, so that a full fleet is not asked
        twenty times a second for as long as its jobs run."""
        capacity = await self.capacity.get()
        if capacity.free_slots - self._unplaced <= 0 or len(self._jobs) >= self.settings.max_jobs:
            self._job_ended.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._job_ended.wait(), self._full_wait_s)
            self._full_wait_s = min(self._full_wait_s * 2, FULL_WAIT_MAX_S)
            return None  # the capacity answer is stale by now (its TTL is the shortest wait)
        self._full_wait_s = FULL_WAIT_MIN_S
        # Reserve the slot before reading, so that a lower priority never overtakes a higher
        # one and a slot is never promised twice.
        self._unplaced += 1
        try:
            entry = await read_next(self.redis, STREAMS, GROUP, self.consumer, block_ms=500)
        except BaseException:
            self._unplaced -= 1
            raise
        if entry is None:
            self._unplaced -= 1
        return entry

    async def _handle(self, entry: Entry, reserved: bool = False) -> None:
        """Run the entry's job to a final state, then acknowledge the entry. With `reserved`, the
        caller counted the job in `_unplaced`; it is uncounted once the job is placed (or ends).
        The entry is acknowledged only once the job's final state is stored: a stop or an error
        before that leaves it pending, for another dispatcher to reclaim."""
        job_id = entry.fields.get("job_id", b"").decode()
        self._own.add((entry.stream, entry.id))
        keeper = asyncio.create_task(self._hold(entry, asyncio.current_task()))
        if not reserved:
            self._unplaced += 1
        self._active += 1
        handling = _Handling()
        try:
            with bind_context(job_id=job_id):
                await self._run_entry(entry, job_id, handling)
        finally:
            self._active -= 1
            if handling.counted:
                self._unplaced -= 1
            self._cancels.pop(job_id, None)
            keeper.cancel()
            self._own.discard((entry.stream, entry.id))
            self.capacity.invalidate()
            self._job_ended.set()
            if handling.final:
                await self.queue.done(entry.stream, entry.id)
            else:  # left for another run: no need to wait for the lease to lapse
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.queue.let_go(entry.stream, entry.id, self.consumer))

    async def _run_entry(self, entry: Entry, job_id: str, handling: _Handling) -> None:
        """Start the entry's job (unless it is gone, final, or delivered too often) and run it."""
        # Listen for its cancellation before reading the record, so none is missed.
        cancel = self._cancels[job_id] = asyncio.Event()
        record = (
            await self.jobs.begin(job_id, common_pb2.JOB_STATUS_PLANNING, delivery=True) if job_id else None
        )
        if record is None or record.final:
            handling.final = True
            return  # expired, or finished (a cancellation) before it was picked
        # Deliveries, not attempts: a job that failed over between engines within one delivery
        # has more attempts, but its dispatchers did not die.
        if record.deliveries > self.settings.max_deliveries:
            await self._give_up(entry, record.deliveries - 1)
            handling.final = True
            return
        if record.cancel_requested:
            cancel.set()
        await self._run(
            JobRun(record, default_timeout_s=self.settings.default_timeout_s, cancel=cancel), handling
        )
        handling.final = True
        if self.on_finished is not None:
            self.on_finished(time.time() - record.submitted_at)

    async def _run(self, run: JobRun, handling: _Handling) -> None:
        """Run the job through the pipeline; it stops counting as unplaced once placed."""
        task = asyncio.create_task(self.pipeline.run(run))
        try:
            placed = asyncio.ensure_future(run.placed.wait())
            await asyncio.wait({task, placed}, return_when=asyncio.FIRST_COMPLETED)
            placed.cancel()
            self._unplaced -= 1
            handling.counted = False
            self.capacity.invalidate()
            await task
        except asyncio.CancelledError:
            # A stop: the saga unwinds (releasing its slot) before the entry is left.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise

    async def _hold(self, entry: Entry, handling: asyncio.Task | None) -> None:
        """Renew the lease on the entry three times a lease while its job runs (Redis errors are
        waited out: the reclaimers give a holder a third of a lease after Redis answers again).
        When another dispatcher holds the lease, it runs the job now: this run is stopped, its slot
        given back, and its entry left to that dispatcher."""
        while True:
            try:
                held = await self.queue.renew(entry.stream, entry.id, self.consumer)
            except Exception:
                held = True  # Redis unreachable: nobody else can have taken it meanwhile
            if not held:
                log.warning("another dispatcher took over the job: stopping this run", entry=entry.id)
                if handling is not None:
                    handling.cancel()
                return
            await asyncio.sleep(self.queue.lease_ms / 3000)

    async def _give_up(self, entry: Entry, attempts: int) -> None:
        reason = f"gave up after {attempts} deliveries (its dispatchers kept dying)"
        result = common_pb2.InferenceResult(
            job_id=entry.fields["job_id"].decode(),
            status=common_pb2.JOB_STATUS_FAILED,
            error=reason,
            finish_reason=common_pb2.FINISH_REASON_ERROR,
        )
        # The result first: a reception dying in between leaves an entry that is redelivered and
        # finds its job final, never a job whose entry is gone while it still looks in progress.
        await self.jobs.finish(result.job_id, result)
        await dead_letter(self.redis, entry, GROUP, DEAD_LETTER, delivered=attempts, reason=reason)
        log.error("job dead-lettered", reason=reason)

    async def _reclaimer(self) -> None:
        """Take over the entries whose holder is gone (its lease stayed gone for a whole lease).
        An entry delivered far too often (its job crashes whoever runs it before its record counts
        the delivery) goes to the dead-letter stream."""
        while not self._draining:
            await asyncio.sleep(self.queue.lease_ms / 4000)
            try:
                for entry in await self._reclaim.orphans(self._own):
                    if entry.deliveries > self.settings.max_deliveries + 2:
                        await dead_letter(
                            self.redis, entry, GROUP, DEAD_LETTER, delivered=entry.deliveries - 1
                        )
                        continue
                    log.warning("reclaimed a job whose dispatcher is gone", entry=entry.id)
                    self._spawn(self._handle(entry))
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError) as error:  # an outage: one line, no trace
                log.warning("reclaim skipped: Redis unreachable", error=str(error))
            except Exception as error:
                if missing_group(error):
                    await self._restore_queue()
                else:
                    log.exception("reclaim failed")

    async def _expiry(self, period_s: float = 0.25) -> None:
        """End the jobs whose deadline passed and that nobody ended (JobStore.sweep_overdue): queued
        ones at once, others `sweep_grace_s` later. A swept job that had been placed has its slot
        given back here, since the dispatcher that held it is gone."""
        while True:
            await asyncio.sleep(period_s)
            try:
                for job_id, status in await self.jobs.sweep_overdue(self.settings.sweep_grace_s):
                    if status == common_pb2.JOB_STATUS_QUEUED:
                        log.warning("job timed out in the queue", job_id=job_id)
                        continue
                    log.warning(
                        "swept a job past its deadline that no dispatcher ended",
                        job_id=job_id,
                        status=common_pb2.JobStatus.Name(status),
                    )
                    await asyncio.shield(self.pipeline.stages.release(job_id))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sweeping overdue jobs failed")

    async def _queue_gauge(self, period_s: float = 1.0) -> None:
        """Keep the queue-depth gauge current (every dispatcher sets it: they all see one queue)."""
        while True:
            try:
                for priority, depth in (await self.queue.depths()).items():
                    self.metrics.queue_depth.labels(str(priority)).set(depth)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the queue depth failed")
            await asyncio.sleep(period_s)

    async def _cancellations(self) -> None:
        """Follow the cancel channel; when the subscription is lost (Redis restarted or unreachable),
        subscribe again and catch up with the cancellations of running jobs missed meanwhile
        (CancelJob also marks the record)."""
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(CANCEL_CHANNEL)
                await self._catch_up_cancellations()
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    cancel = self._cancels.get(message["data"].decode())
                    if cancel is not None:
                        cancel.set()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("cancel subscription lost: subscribing again", error=str(error))
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _catch_up_cancellations(self) -> None:
        for job_id, cancel in list(self._cancels.items()):
            record = await self.jobs.get(job_id)
            if record is not None and record.cancel_requested:
                cancel.set()
