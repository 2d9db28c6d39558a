"""The RouterService registry calls over real gRPC, on embedded Qdrant with the real encoder:
register (idempotent per version), get, list, unregister, and refusals naming the field."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from libs.errors import field_violations
from libs.experts.manifest import BaseModelIdentity
from libs.experts.peft_adapter import read_peft_adapter
from libs.gen.expert.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.embedding import SentenceEncoder
from services.router.index import ExpertIndex
from services.router.metrics import RouterMetrics
from services.router.planner import Planner
from services.router.registry import Registry
from services.router.server import RouterServicer
from services.router.stats import ExpertStats
from tests.helpers.in_process import serving, shared_metrics
from tests.helpers.manifests import manifest_for
from tests.helpers.peft_adapters import write_all_adapters

HASH = "ab" * 32


@pytest.fixture(scope="module")
def manifest_json(tiny_llama, tmp_path_factory) -> bytes:
    lora = read_peft_adapter(write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))["lora"])
    manifest = manifest_for(
        lora, BaseModelIdentity.from_dir(tiny_llama), name="json-parser", task_types=("json_parsing",)
    )
    return manifest.to_json_bytes()


def _scenario(tmp_path, check, stats: ExpertStats | None) -> None:
    async def main():
        client = ExpertIndex.connect(data_dir=tmp_path) if stats else None
        index = ExpertIndex(client, SentenceEncoder.from_package(), stats) if client else None
        registry = Registry(index) if index else None
        servicer = RouterServicer(Planner(index), shared_metrics(RouterMetrics), registry)

        def register(server: grpc.aio.Server) -> list[str]:
            router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
            return ["expert.v1.RouterService"]

        try:
            async with serving(register) as target, grpc.aio.insecure_channel(target) as channel:
                await check(router_pb2_grpc.RouterServiceStub(channel))
        finally:
            if client is not None:
                client.close()

    asyncio.run(main())


def test_register_get_list_and_unregister(tmp_path, manifest_json, expert_stats):
    async def check(stub):
        request = router_pb2.RegisterExpertRequest(
            manifest_json=manifest_json, content_hash=HASH, weight_bytes=4096
        )
        first = await stub.RegisterExpert(request)
        assert first.created and first.expert.name == "json-parser" and first.expert.version == "1.0.0"
        assert list(first.expert.task_types) == ["json_parsing"] and first.expert.weight_bytes == 4096
        assert first.expert.success_rate == 0.5 and first.expert.registered_at.seconds > 0
        again = await stub.RegisterExpert(request)
        assert not again.created
        got = await stub.GetRegisteredExpert(router_pb2.GetRegisteredExpertRequest(name="json-parser"))
        assert got.expert.content_hash == HASH
        listed = await stub.ListRegisteredExperts(router_pb2.ListRegisteredExpertsRequest())
        assert [e.name for e in listed.experts] == ["json-parser"]
        gone = await stub.UnregisterExpert(router_pb2.UnregisterExpertRequest(name="json-parser"))
        assert gone.expert.name == "json-parser"
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetRegisteredExpert(router_pb2.GetRegisteredExpertRequest(name="json-parser"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    _scenario(tmp_path, check, expert_stats)


def test_plan_selects_a_registered_expert_and_names_its_package(tmp_path, manifest_json, expert_stats):
    async def check(stub):
        plan_for = router_pb2.PlanRequest(
            job_id="j", request=common_pb2.InferenceRequest(prompt='Parse this JSON: {"a": 1}')
        )
        before = (await stub.Plan(plan_for)).plan
        assert before.fallback and not before.experts
        await stub.RegisterExpert(
            router_pb2.RegisterExpertRequest(
                manifest_json=manifest_json, content_hash=HASH, weight_bytes=4096
            )
        )
        plan = (await stub.Plan(plan_for)).plan
        assert not plan.fallback and list(plan.composition_order) == ["json-parser"]
        (expert,) = plan.experts
        assert (expert.name, expert.version, expert.adapter_type) == ("json-parser", "1.0.0", "lora")
        assert (expert.content_hash, expert.vram_bytes, expert.weight, expert.forced) == (
            HASH,
            4096,
            1.0,
            False,
        )
        assert (
            expert.score > 0
            and f"candidate json-parser@1.0.0 score {expert.score:.3f}" in plan.reasoning_trace
        )
        forced = common_pb2.InferenceRequest(prompt="Hello", force_experts=["json-parser"])
        assert (await stub.Plan(router_pb2.PlanRequest(job_id="k", request=forced))).plan.experts[0].forced

    _scenario(tmp_path, check, expert_stats)


def test_bad_registrations_are_refused_naming_the_fields(tmp_path, manifest_json, expert_stats):
    async def check(stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RegisterExpert(
                router_pb2.RegisterExpertRequest(
                    manifest_json=manifest_json, content_hash="xyz", weight_bytes=0
                )
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(refused.value)] == ["content_hash", "weight_bytes"]
        bad = json.loads(manifest_json)
        bad["rank"] = -1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RegisterExpert(
                router_pb2.RegisterExpertRequest(
                    manifest_json=json.dumps(bad).encode(), content_hash=HASH, weight_bytes=1
                )
            )
        assert [f for f, _ in field_violations(refused.value)] == ["manifest_json.rank"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RegisterExpert(
                router_pb2.RegisterExpertRequest(
                    manifest_json=b"{not json", content_hash=HASH, weight_bytes=1
                )
            )
        assert [f for f, _ in field_violations(refused.value)] == ["manifest_json"]

    _scenario(tmp_path, check, expert_stats)


def test_a_router_without_an_index_refuses_registry_calls(tmp_path):
    async def check(stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListRegisteredExperts(router_pb2.ListRegisteredExpertsRequest())
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    _scenario(tmp_path, check, None)
