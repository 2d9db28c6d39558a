"""Reception's pipeline against the real router, preparation and postproc servicers and a real Redis,
served in-process so that a stage can be held at the moment a cancellation or a deadline lands."""

from __future__ import annotations

import asyncio
import time

import grpc
from redis.asyncio import Redis

from libs.gen.expert.v1 import (
    common_pb2,
    postproc_pb2_grpc,
    preparation_pb2,
    preparation_pb2_grpc,
    router_pb2_grpc,
)
from services.postproc.finalizer import Finalizer
from services.postproc.metrics import PostprocMetrics
from services.postproc.server import PostprocServicer
from services.preparation.fleet import Fleet
from services.preparation.server import PreparationServicer
from services.reception.dispatch.pipeline import Pipeline
from services.reception.dispatch.run import JobRun
from services.reception.dispatch.stages import GrpcStages
from services.reception.jobs import JobStore
from services.reception.peers import Peers
from services.router.metrics import RouterMetrics
from services.router.planner import Planner
from services.router.server import RouterServicer
from tests.helpers.in_process import preparation_parts, serving, shared_metrics

MODEL = common_pb2.ModelSpec(
    name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4, max_model_len=1024, block_size=16
)


class SlowPreparation(PreparationServicer):
    """The real preparation, answering Prepare only after `delay_s` (its placement already made)."""

    def __init__(self, delay_s: float, store_dir) -> None:
        fleet, preparer, metrics = preparation_parts(store_dir)
        super().__init__(fleet, preparer, metrics, heartbeat_interval_s=30.0)
        self.delay_s = delay_s
        self.preparing = asyncio.Event()

    async def Prepare(self, request, context):
        response = await super().Prepare(request, context)
        self.preparing.set()
        await asyncio.sleep(self.delay_s)
        return response


async def _pipeline_scenario(redis_url: str, store_dir, *, timeout_ms: int | None, cancel: bool) -> Fleet:
    redis = Redis.from_url(redis_url)
    preparation = SlowPreparation(delay_s=0.5, store_dir=store_dir)
    preparation.fleet.register(
        common_pb2.EngineInfo(
            engine_id="e1",
            address="127.0.0.1:1",  # never reached: the job stops while it is being placed
            model=MODEL,
            load=common_pb2.EngineLoad(kv_blocks_total=64, kv_blocks_free=64, max_num_seqs=1),
        )
    )

    async def publish(stream: str, fields: dict[str, bytes]) -> None:
        await redis.xadd(stream, fields)

    def register(server: grpc.aio.Server) -> list[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(
            RouterServicer(Planner(), shared_metrics(RouterMetrics)), server
        )
        preparation_pb2_grpc.add_PreparationServiceServicer_to_server(preparation, server)
        postproc_pb2_grpc.add_PostprocServiceServicer_to_server(
            PostprocServicer(Finalizer(publish, shared_metrics(PostprocMetrics))), server
        )
        return ["expert.v1.RouterService", "expert.v1.PreparationService", "expert.v1.PostprocService"]

    async with serving(register) as target:
        jobs = JobStore(redis, ttl_s=60)
        peers = Peers(target, target, target)
        pipeline = Pipeline(
            jobs,
            GrpcStages(peers),
            engine_retries=0,
            fleet=lambda: preparation_pb2.GetCapacityResponse(
                models=[common_pb2.ServedModel(name="tiny", max_model_len=1024)]
            ),
        )
        request = common_pb2.InferenceRequest(prompt="What is the capital of France?", max_tokens=8)
        if timeout_ms is not None:
            request.timeout_ms = timeout_ms
        await jobs.create("job-1", request, 5)
        run = JobRun(await jobs.get("job-1"))
        task = asyncio.create_task(pipeline.run(run))
        # A cold process can spend the 200 ms deadline before the Prepare is sent: then the job
        # ends without reaching preparation, and nothing waits for a Prepare that never comes.
        preparing = asyncio.create_task(preparation.preparing.wait())
        await asyncio.wait({task, preparing}, return_when=asyncio.FIRST_COMPLETED)
        preparing.cancel()
        if cancel:
            run.cancel.set()
        result = await task
        await peers.close()
    await redis.aclose()
    assert result.status == (common_pb2.JOB_STATUS_CANCELLED if cancel else common_pb2.JOB_STATUS_TIMED_OUT)
    return preparation.fleet


def test_a_job_cancelled_while_it_is_placed_gives_its_engine_slot_back(clean_redis_url, tmp_path):
    fleet = asyncio.run(_pipeline_scenario(clean_redis_url, tmp_path, timeout_ms=None, cancel=True))
    assert fleet.jobs == {} and fleet.engines["e1"].free_slots == 1


def test_a_job_whose_deadline_passes_while_it_is_placed_gives_its_slot_back(clean_redis_url, tmp_path):
    fleet = asyncio.run(_pipeline_scenario(clean_redis_url, tmp_path, timeout_ms=200, cancel=False))
    assert fleet.jobs == {} and fleet.engines["e1"].free_slots == 1


def test_jobs_past_their_deadline_that_nobody_ended_are_swept_timed_out(clean_redis_url):
    async def scenario() -> None:
        redis = Redis.from_url(clean_redis_url)
        jobs = JobStore(redis, ttl_s=60, default_timeout_s=None)
        await jobs.create("short", common_pb2.InferenceRequest(prompt="a", timeout_ms=50), 5)
        await jobs.create("endless", common_pb2.InferenceRequest(prompt="b"), 5)
        await jobs.create("running", common_pb2.InferenceRequest(prompt="c", timeout_ms=50), 5)
        await jobs.set_status("running", common_pb2.JOB_STATUS_RUNNING)
        await jobs.append_delta("running", common_pb2.ChoiceDelta(text="Once upon"))
        assert await jobs.sweep_overdue(30.0) == []
        # A queued job past its deadline ends at once, with no output.
        assert await jobs.sweep_overdue(30.0, now=time.time() + 1) == [
            ("short", common_pb2.JOB_STATUS_QUEUED)
        ]
        short = await jobs.get("short")
        assert short.status == common_pb2.JOB_STATUS_TIMED_OUT and short.result.timed_out
        assert short.result.finish_reason == common_pb2.FINISH_REASON_TIMEOUT
        # A running job is its dispatcher's to end, for the grace after its deadline...
        assert (await jobs.get("running")).status == common_pb2.JOB_STATUS_RUNNING
        assert await redis.zcard("expert:jobs:deadlines") == 1
        # ...then, its owner gone, it is swept TIMED_OUT with the output it had.
        swept = await jobs.sweep_overdue(30.0, now=time.time() + 31)
        assert swept == [("running", common_pb2.JOB_STATUS_RUNNING)]
        running = await jobs.get("running")
        assert (running.status, running.result.text) == (common_pb2.JOB_STATUS_TIMED_OUT, "Once upon")
        assert "no dispatcher ended it" in running.result.error
        assert await redis.zcard("expert:jobs:deadlines") == 0
        assert (await jobs.get("endless")).status == common_pb2.JOB_STATUS_QUEUED  # no deadline, never swept
        await redis.aclose()

    asyncio.run(scenario())
