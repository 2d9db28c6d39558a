"""One training job from its record to its end: its data read from its owner's uploads (and
nothing else), its adapter trained under a `JobControl`, its expert packed, signed, stored and
registered. The job ends COMPLETED, FAILED (with the reason) or CANCELLED; when it is taken away
(`Interrupted`: its lease lost, the trainer stopping) it is left as it is, for whoever resumes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import grpc

from libs.experts.errors import ManifestError, PackageError
from libs.experts.packing import ExpertMetadata, check_metadata
from libs.experts.signing import SigningError, load_private_key
from libs.experts.store import StoreError
from libs.logging import get_logger
from libs.training.checkpoint import is_checkpoint
from libs.training.data import DataError, Sample, parse_lines
from libs.training.expert import PackageSpec, PackError, train_expert
from libs.training.files import TrainingFiles
from libs.training.jobs import ACTIVE, CANCELLED, COMPLETED, FAILED, TrainingJob, TrainingJobs
from libs.training.run import PreparedRun
from libs.training.settings import SettingsError, TrainSettings
from libs.training.spec import JobSpec, SpecError, parse_spec
from services.trainer.config import TrainerConfig
from services.trainer.job_control import BudgetSpent, Cancelled, Interrupted, JobControl, Stops
from services.trainer.metrics import TrainerMetrics
from services.trainer.publish import expert_record, register, store_package

log = get_logger(__name__)
# What a job's own spec, data or expert can get wrong: the job fails with the reason, for its owner.
JOB_ERRORS = (
    SpecError,
    DataError,
    SettingsError,
    ManifestError,
    SigningError,
    PackError,
    PackageError,
    StoreError,
)


class JobFailed(Exception):
    """The job cannot go on; the message is for its owner."""


class JobRunner:
    def __init__(
        self, config: TrainerConfig, jobs: TrainingJobs, files: TrainingFiles, router, metrics: TrainerMetrics
    ) -> None:
        self.config = config
        self.jobs = jobs
        self.files = files
        self.router = router
        self.metrics = metrics

    async def run(self, job: TrainingJob, stops: Stops) -> None:
        """Runs `job` (already RUNNING) to its end; raises Interrupted when it was taken away."""
        try:
            expert = await self._train_and_publish(job, stops)
        except Cancelled:
            await self._finish(job, CANCELLED, "job cancelled; its checkpoints are kept for its retention")
        except BudgetSpent as stop:
            await self._finish(job, FAILED, str(stop), error=str(stop))
        except Interrupted:
            self.metrics.jobs.labels("HANDED_BACK").inc()
            raise
        except (JobFailed, *JOB_ERRORS) as error:
            await self._finish(job, FAILED, f"job failed: {error}", error=str(error))
        except grpc.aio.AioRpcError as error:
            reason = f"the expert is stored, but the router did not register it: {error.details()}"
            await self._finish(job, FAILED, reason, error=reason)
        except Exception as error:
            log.exception("training job failed", job_id=job.job_id)
            reason = f"internal error: {type(error).__name__}: {error}"
            await self._finish(job, FAILED, reason, error=reason)
        else:
            await self._finish(job, COMPLETED, f"expert {expert['model']} is installed", expert=expert)

    async def _train_and_publish(self, job: TrainingJob, stops: Stops) -> dict:
        spec = parse_spec(job.spec)
        self._check_base_model(spec)
        samples, held_out = await self._samples(job, spec)
        directory = self.config.checkpoint_dir / job.job_id
        resume = self._resume_point(job)
        if job.resume_from:  # asked for once: a later restart goes on from the latest checkpoint
            await self.jobs.update(job.job_id, resume_from="")
        if resume is not None:
            await self.jobs.event(
                job.job_id, "status", f"resuming from checkpoint {resume['id']} (step {resume['step']})"
            )
        control = JobControl(
            self.jobs,
            job.job_id,
            asyncio.get_running_loop(),
            directory,
            spec.checkpoint_every_steps or self.config.checkpoint_steps,
            float(spec.time_budget_seconds or self.config.bounds.max_seconds),
            float(job.metrics.get("training_seconds") or 0.0),
            list(job.checkpoints),
            Path(resume["path"]) if resume else None,
            stops,
            self.metrics,
        )
        package = directory / f"{spec.expert.name}-{spec.expert.version}.expert"
        if package.is_file():
            # Written (atomically) once training finished, by a run that stopped before the expert
            # was registered: packing again could give other bytes (peft writes a set's order), which
            # the store would refuse under the same name and version.
            await self.jobs.event(job.job_id, "status", "the expert was trained and packed already")
        else:
            summary = await asyncio.to_thread(self._train, spec, samples, held_out, control, package)
            await self.jobs.update(job.job_id, metrics={**job.metrics, **_final_metrics(summary, control)})
        entry = await asyncio.to_thread(
            store_package, package, self.config.store, self.config.trusted_keys, self.config.model_path
        )
        await register(self.router, entry)
        return expert_record(entry, self.config.served_model)

    def _train(
        self,
        spec: JobSpec,
        samples: list[Sample],
        held_out: list[Sample] | None,
        control: JobControl,
        package: Path,
    ) -> dict:
        """In the training thread: check what can be checked before the model loads, then train and pack."""
        if self.config.signing_key is None:
            raise JobFailed(
                "this deployment has no publisher key to sign experts with (EXPERT_TRAINER_SIGNING_KEY)"
            )
        key = load_private_key(self.config.signing_key)
        metadata = ExpertMetadata(
            name=spec.expert.name,
            version=spec.expert.version,
            description=spec.expert.description or f"trained by job {control.job_id}",
            keywords=spec.expert.keywords,
        )
        check_metadata(metadata, self.config.model_path)
        prepared = PreparedRun(self.config.model_path, samples, self._settings(spec), held_out)
        out = control.directory / "adapter"
        return train_expert(prepared, out, PackageSpec(metadata, key, package), control=control)

    def _settings(self, spec: JobSpec) -> TrainSettings:
        bound = self.config.bounds.max_sequence_length
        device = None if self.config.device == "auto" else self.config.device
        return dataclasses.replace(
            spec.settings, max_length=min(spec.settings.max_length or bound, bound), device=device
        )

    def _check_base_model(self, spec: JobSpec) -> None:
        names = {self.config.served_model, self.config.model_path.name}
        if spec.base_model and spec.base_model not in names:
            raise JobFailed(f"base_model: this deployment trains adapters of {self.config.served_model} only")

    async def _samples(self, job: TrainingJob, spec: JobSpec) -> tuple[list[Sample], list[Sample] | None]:
        """The job's data, read by file id as its owner: a job reads nothing but its owner's uploads."""
        samples = await self._file(job, "training_file", spec.training_file)
        held_out = (
            await self._file(job, "validation_file", spec.validation_file) if spec.validation_file else None
        )
        return samples, held_out

    async def _file(self, job: TrainingJob, field: str, file_id: str) -> list[Sample]:
        content = await self.files.content(file_id, job.owner)
        if content is None:
            raise JobFailed(f"{field}: no file {file_id} (deleted since the job was created?)")
        try:
            samples = list(parse_lines(content.decode("utf-8").splitlines(), file_id))
        except UnicodeDecodeError:
            raise JobFailed(f"{field}: {file_id} is not UTF-8 text") from None
        if not samples:
            raise JobFailed(f"{field}: {file_id} holds no samples")
        return samples

    def _resume_point(self, job: TrainingJob) -> dict | None:
        """The checkpoint to go on from: the one `resume` named, else the last one still on disk."""
        usable = [c for c in job.checkpoints if is_checkpoint(Path(c["path"]))]
        if job.resume_from:
            named = [c for c in usable if c["id"] == job.resume_from]
            if not named:
                raise JobFailed(
                    f"checkpoint_id: checkpoint {job.resume_from} is gone from the trainer's disk"
                )
            return named[0]
        return usable[-1] if usable else None

    async def _finish(
        self, job: TrainingJob, status: str, message: str, error: str = "", expert: dict | None = None
    ) -> None:
        fields: dict = {"finished_at": repr(time.time()), "cancel_requested": "0", "resume_from": ""}
        if error:
            fields["error"] = error
        if expert is not None:
            fields["expert"] = expert
        await self.jobs.transition(job.job_id, ACTIVE, status, **fields)
        self.metrics.jobs.labels(status).inc()
        await self.jobs.event(
            job.job_id, "status", message, {"status": status, **({"expert": expert} if expert else {})}
        )
        log.info("training job ended", job_id=job.job_id, status=status, reason=error or None)


def _final_metrics(summary: dict, control: JobControl) -> dict:
    adapter = summary["adapter"]
    epochs = adapter["epochs"]
    last = epochs[-1] if epochs else {}
    best = next((e for e in epochs if e["epoch"] == adapter["best_epoch"]), last)
    return {
        "step": adapter["steps"],
        "train_loss": last.get("train_loss"),
        "eval_loss": best.get("eval_loss"),
        "best_epoch": adapter["best_epoch"],
        "tokens_per_second": adapter["tokens_per_second"],
        # the tokens of every sample of every epoch (a checkpoint keeps the epochs run before it)
        "trained_tokens": sum(e["tokens"] for e in epochs),
        "eta_seconds": 0,
        "training_seconds": control.training_seconds(),
        "device": adapter["device"],
    }
