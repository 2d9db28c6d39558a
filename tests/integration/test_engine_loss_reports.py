"""What the job saga (services/reception/dispatch/pipeline.py) tells preparation about an engine:
only evidence about the engine (a stream that broke) is reported, once, in the next attempt's first
Prepare; an engine that answered, whether it refused the request (the client's error: the job
fails) or failed it (INTERNAL: the job runs again), is never reported lost. Stages in memory, a
real Redis for the job records (as tests/integration/test_reception_saga.py)."""

from __future__ import annotations

import grpc

from libs.gen.expert.v1 import common_pb2
from libs.job_results import failure_code
from tests.integration.test_reception_saga import (
    FakeStages,
    assert_one_release_per_placement,
    rpc_error,
    run_saga,
)


class RecordingStages(FakeStages):
    """FakeStages keeping every PrepareRequest; placements go to engine-1, engine-2... (one
    process each), and the first `busy` Prepares after the first placement find no room."""

    def __init__(self, engines, busy: int = 0) -> None:
        super().__init__(engines=engines)
        self.requests = []
        self.busy = busy

    async def prepare(self, request, timeout):
        self.requests.append(request)
        if self.placements[request.job_id] and self.busy:
            self.busy -= 1
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no engine has room")
        placement = await super().prepare(request, timeout)
        placement.engine_instance_id = f"process-{self.placements[request.job_id]}"
        return placement

    def reported(self) -> list[list[tuple[str, str]]]:
        return [[(e.engine_id, e.instance_id) for e in r.lost_engines] for r in self.requests]


def test_an_engine_refusing_the_request_fails_the_job_and_is_never_reported_lost(clean_redis_url):
    stages = RecordingStages(engines=(grpc.StatusCode.INVALID_ARGUMENT, "complete"))
    result = run_saga(clean_redis_url, stages, retries=2)
    assert result.status == common_pb2.JOB_STATUS_FAILED
    assert failure_code(result) == grpc.StatusCode.INVALID_ARGUMENT
    assert stages.reported() == [[]]
    assert_one_release_per_placement(stages, 1)


def test_an_engine_answering_internal_runs_the_job_again_without_reporting_the_engine(clean_redis_url):
    stages = RecordingStages(engines=(grpc.StatusCode.INTERNAL, "complete"))
    result = run_saga(clean_redis_url, stages, retries=1)
    assert result.status == common_pb2.JOB_STATUS_COMPLETED, result.error
    assert stages.reported() == [[], []]
    assert_one_release_per_placement(stages, 2)


def test_a_broken_stream_is_reported_once_however_long_the_job_waits_for_room(clean_redis_url):
    stages = RecordingStages(engines=("die", "complete"), busy=4)
    result = run_saga(clean_redis_url, stages, retries=1, timeout_ms=10_000)
    assert result.status == common_pb2.JOB_STATUS_COMPLETED, result.error
    assert stages.reported() == [[], [("engine-1", "process-1")], [], [], [], []]
    assert_one_release_per_placement(stages, 2)


def test_every_attempt_counts_against_the_retry_budget(clean_redis_url):
    stages = RecordingStages(engines=(grpc.StatusCode.INTERNAL, "die", grpc.StatusCode.INTERNAL, "complete"))
    result = run_saga(clean_redis_url, stages, retries=2)
    assert result.status == common_pb2.JOB_STATUS_FAILED and "failed" in result.error
    assert failure_code(result) == grpc.StatusCode.UNAVAILABLE
    assert stages.reported() == [[], [], [("engine-2", "process-2")]]
    assert_one_release_per_placement(stages, 3)
