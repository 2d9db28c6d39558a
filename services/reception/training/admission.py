"""What reception does with training jobs, for both fronts: the caller's own jobs only (another
key's job is NOT_FOUND, as one that does not exist), every spec problem and every bound gone over
(every ceiling of libs/training/bounds.py, this deployment's EXPERT_TRAINING_MAX_* among them)
refused at once as INVALID_ARGUMENT naming the fields, and the state changes the job's status
allows (FAILED_PRECONDITION naming the status otherwise). The trainer does the work
(services/trainer); this only writes and reads the records in Redis (libs.training.jobs)."""

from __future__ import annotations

from typing import Any

from libs.errors import failed_precondition, invalid_argument, invalid_arguments, not_found
from libs.training.bounds import TrainingBounds, bound_violations, planned_steps, setting_violations
from libs.training.files import TrainingFiles
from libs.training.jobs import CANCELLED, COMPLETED, TrainingJob, TrainingJobs
from libs.training.spec import JobSpec, SpecError, parse_spec

MAX_PAGE = 100
MAX_EVENTS = 1000


class TrainingAdmission:
    def __init__(self, jobs: TrainingJobs, files: TrainingFiles, bounds: TrainingBounds) -> None:
        self.jobs = jobs
        self.files = files
        self.bounds = bounds

    async def create(self, owner: str, raw_spec: Any) -> TrainingJob:
        """Queue a job for `owner` from the spec's JSON form."""
        try:
            spec = parse_spec(raw_spec)
        except SpecError as error:
            raise invalid_arguments(error.violations) from None
        stored = spec.to_dict()
        problems = setting_violations(self.bounds, stored)
        counts, file_problems = await self._count_samples(spec, owner)
        problems += file_problems
        if "training_file" in counts:
            s = spec.settings
            steps = planned_steps(
                counts["training_file"], bool(spec.validation_file), s.epochs, s.batch_size, s.eval_fraction
            )
            problems += bound_violations(
                self.bounds,
                steps=min(steps, s.max_steps or steps),
                max_steps_given=s.max_steps is not None,
                samples=counts,
            )
        if problems:
            raise invalid_arguments(problems)
        return await self.jobs.create(owner, stored)

    async def _count_samples(self, spec: JobSpec, owner: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """The samples (non-blank lines) of the spec's files, read as the caller: a job can name
        only its owner's uploads."""
        counts, problems = {}, []
        for name, file_id in (
            ("training_file", spec.training_file),
            ("validation_file", spec.validation_file),
        ):
            if not file_id:
                continue
            content = await self.files.content(file_id, owner)
            if content is None:
                problems.append(
                    (name, f"no file {file_id[:64]!r} among yours (upload it first: POST /v1/files)")
                )
                continue
            counts[name] = sum(1 for line in content.splitlines() if line.strip())
            if counts[name] == 0:
                problems.append((name, f"file {file_id} holds no samples"))
        return counts, problems

    async def get(self, owner: str, job_id: str) -> TrainingJob:
        job = await self.jobs.get(job_id, owner) if job_id else None
        if job is None:
            raise not_found(f"no training job {job_id[:64]!r}")
        return job

    async def list(self, owner: str, limit: int, after: str) -> tuple[list[TrainingJob], bool]:
        if not 0 <= limit <= MAX_PAGE:
            raise invalid_argument("limit", f"must be in [1, {MAX_PAGE}] (0: 20), got {limit}")
        limit = limit or 20
        jobs = await self.jobs.list(owner, limit + 1, after)
        return jobs[:limit], len(jobs) > limit

    async def cancel(self, owner: str, job_id: str) -> TrainingJob:
        """Cancels a pending job, asks a running one to stop; a cancelled one is left as it is."""
        job = await self.get(owner, job_id)
        if job.status == COMPLETED or (job.final and job.status != CANCELLED):
            raise failed_precondition(
                f"training job {job_id} is {job.status}: only an unfinished job can be cancelled"
            )
        await self.jobs.cancel(job_id)
        return await self.get(owner, job_id)

    async def checkpoint(self, owner: str, job_id: str) -> str:
        await self.get(owner, job_id)
        checkpoint_id = await self.jobs.request_checkpoint(job_id)
        if checkpoint_id is None:
            job = await self.get(owner, job_id)
            raise failed_precondition(
                f"training job {job_id} is {job.status}: only a running job can be checkpointed"
            )
        return checkpoint_id

    async def checkpoints(self, owner: str, job_id: str) -> list[dict[str, Any]]:
        return (await self.get(owner, job_id)).public_checkpoints()

    async def resume(self, owner: str, job_id: str, checkpoint_id: str) -> TrainingJob:
        """Queues a cancelled or failed job again, from `checkpoint_id` (its last one when "")."""
        job = await self.get(owner, job_id)
        if checkpoint_id and checkpoint_id not in {c["id"] for c in job.checkpoints}:
            raise invalid_argument(
                "checkpoint_id", f"training job {job_id} has no checkpoint {checkpoint_id[:64]!r}"
            )
        if not await self.jobs.resume(job_id, checkpoint_id):
            job = await self.get(owner, job_id)
            raise failed_precondition(
                f"training job {job_id} is {job.status}: only a cancelled or failed job can be resumed"
            )
        return await self.get(owner, job_id)

    async def events(
        self, owner: str, job_id: str, after: str, limit: int, newest_first: bool = False
    ) -> list[dict[str, Any]]:
        await self.get(owner, job_id)
        if not 0 <= limit <= MAX_EVENTS:
            raise invalid_argument("limit", f"must be in [1, {MAX_EVENTS}] (0: 100), got {limit}")
        try:
            return await self.jobs.events(job_id, after, limit or 100, newest_first)
        except Exception as error:
            if "Invalid stream ID" in str(error):
                raise invalid_argument("after", f"not an event id: {after[:64]!r}") from None
            raise
