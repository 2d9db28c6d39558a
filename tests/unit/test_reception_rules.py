"""Reception's rules that other places used to copy, each now written once: which job statuses are
final (services.reception.jobs.FINAL, which the admission core's cancel_job follows for CancelJob
and every front) and how long a release may take (services.reception.dispatch.stages.RELEASE_TIMEOUT_S,
for a job's slot and for a session's KV alike)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from libs.gen.expert.v1 import common_pb2, engine_pb2, preparation_pb2
from services.reception.admission.core import Admission
from services.reception.dispatch.stages import RELEASE_TIMEOUT_S, GrpcStages
from services.reception.jobs import FINAL

LIVE = [s for s in common_pb2.JobStatus.values() if s and s not in FINAL]


class Jobs:
    """A job store holding one job of a given status; records what CancelJob asks of it."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.finished: list[int] = []
        self.cancel_requested = False

    async def get(self, job_id):
        return self

    def to_proto(self, text: str) -> common_pb2.Job:
        return common_pb2.Job(job_id="job-1", status=self.status)

    async def text(self, job_id):
        return ""

    async def finish(self, job_id, result) -> bool:
        self.finished.append(result.status)
        return True

    async def request_cancel(self, job_id) -> None:
        self.cancel_requested = True


def cancel(status: int) -> Jobs:
    jobs = Jobs(status)
    admission = Admission(jobs, queue=None, capacity=None, metrics=None)
    asyncio.run(admission.cancel_job("job-1"))
    return jobs


def test_the_final_statuses_are_those_that_sort_after_the_live_ones():
    assert set(FINAL) == {s for s in common_pb2.JobStatus.values() if s >= common_pb2.JOB_STATUS_COMPLETED}


@pytest.mark.parametrize("status", FINAL, ids=common_pb2.JobStatus.Name)
def test_cancelling_a_job_in_a_final_status_leaves_it_as_it_is(status):
    jobs = cancel(status)
    assert (jobs.finished, jobs.cancel_requested) == ([], False)


@pytest.mark.parametrize("status", LIVE, ids=common_pb2.JobStatus.Name)
def test_cancelling_a_live_job_stops_it(status):
    jobs = cancel(status)
    if status == common_pb2.JOB_STATUS_QUEUED:  # nobody runs it yet: it ends here
        assert jobs.finished == [common_pb2.JOB_STATUS_CANCELLED]
    else:
        assert jobs.cancel_requested


class Recorder:
    """A unary method of a stub: records the timeout of each call."""

    def __init__(self, response) -> None:
        self.response = response
        self.timeouts: list[float | None] = []

    async def __call__(self, request, timeout=None, metadata=None):
        self.timeouts.append(timeout)
        return self.response


class EngineChannel:
    """What an engine stub is built on: each of its methods is a Recorder."""

    def __init__(self) -> None:
        self.methods: dict[str, Recorder] = {}

    def unary_unary(self, method, *args, **kwargs) -> Recorder:
        return self.methods.setdefault(method, Recorder(engine_pb2.ReleaseSessionResponse()))

    unary_stream = stream_unary = stream_stream = unary_unary


def test_a_jobs_slot_and_a_sessions_kv_are_released_within_the_same_timeout():
    release = Recorder(preparation_pb2.ReleaseResponse())
    channel = EngineChannel()
    peers = SimpleNamespace(
        preparation=SimpleNamespace(Release=release), engine_channel=lambda address: channel
    )
    stages = GrpcStages(peers)

    async def main():
        await stages.release("job-1")
        await stages.release_session("engine-1:50054", "session-1")

    asyncio.run(main())
    (job_timeout,) = release.timeouts
    (session_timeout,) = channel.methods["/expert.v1.EngineService/ReleaseSession"].timeouts
    assert session_timeout == RELEASE_TIMEOUT_S
    assert RELEASE_TIMEOUT_S - 0.5 < job_timeout <= RELEASE_TIMEOUT_S  # `call` counts down from it
