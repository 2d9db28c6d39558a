"""PreparationService.Release over real gRPC: several jobs in one call (postproc batches the
releases of jobs that finish together), each job's slot freed once, and bad lists refused naming
the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libs.errors import field_violations
from libs.gen.expert.v1 import common_pb2, preparation_pb2, preparation_pb2_grpc
from services.preparation.server import PreparationServicer
from tests.helpers.in_process import preparation_parts, serving

MODEL = common_pb2.ModelSpec(
    name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4, max_model_len=1024, block_size=16
)


def _scenario(check, store_dir) -> None:
    async def main():
        fleet, preparer, metrics = preparation_parts(store_dir)
        preparation = PreparationServicer(fleet, preparer, metrics, 30.0)
        preparation.fleet.register(
            common_pb2.EngineInfo(
                engine_id="e1",
                address="127.0.0.1:1",
                model=MODEL,
                load=common_pb2.EngineLoad(kv_blocks_total=64, kv_blocks_free=64, max_num_seqs=4),
            )
        )

        def register(server: grpc.aio.Server) -> list[str]:
            preparation_pb2_grpc.add_PreparationServiceServicer_to_server(preparation, server)
            return ["expert.v1.PreparationService"]

        async with serving(register) as target, grpc.aio.insecure_channel(target) as channel:
            await check(preparation_pb2_grpc.PreparationServiceStub(channel))

    asyncio.run(main())


def _plan() -> common_pb2.ExpertPlan:
    return common_pb2.ExpertPlan(prompt_bytes=10, generation_params=common_pb2.GenerationParams(max_tokens=6))


def test_one_release_call_frees_several_jobs_each_once(tmp_path):
    async def check(stub):
        for job in ("a", "b", "c"):
            await stub.Prepare(preparation_pb2.PrepareRequest(job_id=job, plan=_plan()))
        assert (await stub.GetCapacity(preparation_pb2.GetCapacityRequest())).free_slots == 1
        released = await stub.Release(preparation_pb2.ReleaseRequest(job_ids=["a", "b", "a", "unknown"]))
        assert released.released == 2
        assert (await stub.GetCapacity(preparation_pb2.GetCapacityRequest())).free_slots == 3

    _scenario(check, tmp_path)


@pytest.mark.parametrize(("job_ids", "field"), [([], "job_ids"), (["a", ""], "job_ids[1]")])
def test_a_release_without_jobs_or_with_a_blank_id_is_refused_naming_the_field(job_ids, field, tmp_path):
    async def check(stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Release(preparation_pb2.ReleaseRequest(job_ids=job_ids))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(refused.value)] == [field]

    _scenario(check, tmp_path)
