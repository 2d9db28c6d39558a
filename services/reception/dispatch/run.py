"""One run of a job through the saga: its record, what each stage gave it so far, its turn policy,
and the race of each stage step against its deadline and its cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from libs.gen.expert.v1 import common_pb2
from services.reception.dispatch.choices import Choices
from services.reception.dispatch.errors import JobStopped
from services.reception.dispatch.turns import PlainTurn, TurnPolicy
from services.reception.jobs import JobRecord, job_deadline

T = TypeVar("T")

# gRPC measures a call's timeout on its own clock: its DEADLINE_EXCEEDED may come a hair before ours.
DEADLINE_SLACK_S = 0.05


@dataclass
class JobRun:
    record: JobRecord
    default_timeout_s: float | None = None  # for requests without timeout_ms
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    choices: Choices = field(default_factory=Choices)
    plan: common_pb2.ExpertPlan = field(default_factory=common_pb2.ExpertPlan)
    placement: common_pb2.Placement = field(default_factory=common_pb2.Placement)
    preparing: asyncio.Future | None = None  # the Prepare call in flight, if any
    model: str = ""  # the model the job runs on ("": any engine, while none was known at planning)
    started: float = field(default_factory=time.time)
    inference_started: float | None = None
    turn: TurnPolicy = field(default_factory=PlainTurn)  # a session's turn, or a plain job
    attempt: int = 0  # the job's runs so far, this one included (its record counts them)
    # The output tokens this run goes on from, which an earlier run (whose engine was lost) already
    # gave the job's readers; the engine sends only what follows (GenerateRequest.resume_token_ids).
    resume: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.attempt = self.attempt or self.record.attempts

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def deadline(self) -> float | None:
        return job_deadline(self.record.request, self.record.submitted_at, self.default_timeout_s)

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.time())

    async def until(
        self,
        awaitable: Awaitable[T],
        grace_s: float = 0.0,
        on_cancel: Callable[[], Awaitable[Any]] | None = None,
    ) -> T:
        """Await one stage step, unless the job is cancelled or its deadline (+ `grace_s`) passes
        first (JobStopped). With `on_cancel`, a cancellation first asks the step to wind down (and
        gives it `grace_s` to do so) before the step is cancelled outright."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self.cancel.wait())
        remaining = self.remaining()
        try:
            done, _ = await asyncio.wait(
                {task, stop},
                timeout=None if remaining is None else remaining + grace_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop.cancel()
        if task in done:
            return task.result()
        if on_cancel is not None and self.cancel.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(on_cancel(), grace_s)
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if task in done:
                return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise JobStopped("cancelled" if self.cancel.is_set() else "timeout")

    def stop_if_expired(self, error: grpc.aio.AioRpcError) -> None:
        """A stage call's timeout is the job's remaining time, so DEADLINE_EXCEEDED past the job's
        deadline is the job timing out (TIMED_OUT, with its partial output), not the stage failing."""
        expired = self.deadline is not None and time.time() >= self.deadline - DEADLINE_SLACK_S
        if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and expired:
            raise JobStopped("timeout") from None
