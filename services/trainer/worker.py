"""The trainer's loop: one job at a time from the training queue (libs.training.queue).

Between jobs it sweeps the checkpoints of jobs past their retention (checkpoint_sweep.py), claims
the entries of jobs whose trainer is gone (their lease stayed gone for a whole lease while it
looked, libs/stream_lease.py: a Redis outage alone takes no job from a living trainer), then waits
for a new entry, at most a quarter of a lease so that it looks at the leases often enough. A job is
run under its lease, renewed three times a lease while it trains; a job another trainer holds is
skipped, a final one dropped, a job delivered more than EXPERT_TRAINER_MAX_DELIVERIES times (it
keeps killing its trainer) failed and dead-lettered. On a stop the running job writes a checkpoint
and is handed back, to go on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from libs.logging import get_logger
from libs.redis_streams import Entry
from libs.training.jobs import ACTIVE, CANCELLED, FAILED, PENDING, RUNNING, TrainingJobs
from libs.training.queue import TrainingQueue, job_id_of
from services.trainer.checkpoint_sweep import CheckpointSweeper
from services.trainer.job_control import Interrupted, Stops
from services.trainer.runner import JobRunner

log = get_logger(__name__)
POLL_MS = 1000


class Worker:
    def __init__(
        self,
        queue: TrainingQueue,
        jobs: TrainingJobs,
        runner: JobRunner,
        max_deliveries: int,
        sweeper: CheckpointSweeper | None = None,
    ) -> None:
        self.queue = queue
        self.jobs = jobs
        self.runner = runner
        self.max_deliveries = max_deliveries
        self.sweeper = sweeper
        self.poll_ms = max(1, min(POLL_MS, queue.lease_ms // 4))
        self.stops = Stops()
        self._stopping = asyncio.Event()
        self.current: str | None = None  # the job id being trained

    def stop(self) -> None:
        """Stop taking jobs; the running one checkpoints after its current step and is handed back."""
        self._stopping.set()
        self.stops.stopping.set()

    async def run(self) -> None:
        await self.queue.setup()
        while not self._stopping.is_set():
            try:
                if self.sweeper is not None:
                    await self.sweeper.sweep_if_due()
                entries = await self.queue.orphans()
                if not entries:
                    entry = await self.queue.next(self.poll_ms)
                    entries = [entry] if entry is not None else []
                for entry in entries:
                    if not self._stopping.is_set():
                        await self.handle(entry)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Redis away: try again shortly, the entries stay pending
                log.warning("the training queue failed", error=str(error))
                self.queue.guard.forget()  # the holders could not renew meanwhile either
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0)

    async def handle(self, entry: Entry) -> None:
        job_id = job_id_of(entry)
        job = await self.jobs.get(job_id)
        if job is None or job.final:
            await self.queue.done(entry)
            return
        if not await self.queue.hold(entry):
            await self.queue.done(entry)  # a second entry of a job another trainer runs
            return
        if entry.deliveries > self.max_deliveries:
            reason = (
                f"the trainer stopped {entry.deliveries - 1} times while training it "
                "(EXPERT_TRAINER_MAX_DELIVERIES)"
            )
            await self.jobs.transition(
                job_id, (PENDING, *ACTIVE), FAILED, error=reason, finished_at=repr(time.time())
            )
            await self.jobs.event(job_id, "status", f"job failed: {reason}", {"status": FAILED})
            await self.queue.dead_letter(entry, reason)
            await self.queue.let_go(entry)
            return
        if job.cancel_requested:
            await self.jobs.transition(job_id, (PENDING, *ACTIVE), CANCELLED, finished_at=repr(time.time()))
            await self.jobs.event(job_id, "status", "job cancelled", {"status": CANCELLED})
            await self.queue.done(entry)
            return
        if not await self.jobs.transition(job_id, (PENDING, *ACTIVE), RUNNING, **_started(job.started_at)):
            await self.queue.done(entry)  # cancelled meanwhile
            return
        await self.jobs.event(
            job_id, "status", "job running", {"status": RUNNING, "trainer": self.queue.consumer}
        )
        await self._run(entry, await self.jobs.get(job_id))

    async def _run(self, entry: Entry, job) -> None:
        self.current, self.stops.lease_lost.clear()
        renewing = asyncio.create_task(self._renew(entry))
        try:
            await self.runner.run(job, self.stops)
        except Interrupted as why:
            log.info("training job handed back", job_id=job.job_id, reason=str(why))
            if not self.stops.lease_lost.is_set():
                await self.queue.let_go(entry)
            return
        finally:
            renewing.cancel()
            self.current = None
        await self.queue.done(entry)

    async def _renew(self, entry: Entry) -> None:
        """Renews the job's lease three times a lease; a lease another trainer took stops the run."""
        while True:
            await asyncio.sleep(self.queue.lease_ms / 3000)
            try:
                if not await self.queue.hold(entry):
                    log.warning("training job lease lost", job_id=job_id_of(entry))
                    self.stops.lease_lost.set()
                    return
            except Exception as error:  # Redis away: the lease may lapse; the next renewal tells
                log.warning("training job lease not renewed", job_id=job_id_of(entry), error=str(error))


def _started(started_at: float | None) -> dict:
    return {} if started_at is not None else {"started_at": repr(time.time())}
