"""Preparation's staging against a real engine (the tiny model behind a real EngineService on a local
port) and a real expert store: a cold expert is sent once, a hot one not at all, room is made by
unloading the least recently used expert no job references, and what cannot be staged says why."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libs.engine.async_engine import AsyncLLMEngine
from libs.errors import ServiceError
from libs.experts.manifest import BaseModelIdentity
from libs.experts.signing import Keyring
from libs.experts.store import ExpertStore
from libs.gen.expert.v1 import common_pb2, engine_pb2_grpc, preparation_pb2
from services.engine.__main__ import map_error
from services.engine.metrics import EngineMetrics
from services.engine.server import EngineServicer, engine_load, expert_holdings, model_spec
from services.preparation.fleet import Fleet, expert_key
from services.preparation.metrics import PreparationMetrics
from services.preparation.preparer import Preparer
from services.preparation.staging import Stager
from tests.helpers.experts import Publisher
from tests.helpers.in_process import serving, shared_metrics
from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter
from tools.stack import free_port

NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def installed(tiny_llama, tmp_path_factory):
    """Three signed LoRA/IA³ packages installed in a store; returns the publisher, the store and the
    planned expert of each."""
    root = tmp_path_factory.mktemp("staging")
    publisher = Publisher.create(root)
    store = ExpertStore(root / "store")
    planned = {}
    for seed, name in enumerate(NAMES):
        writer = write_lora_adapter if seed % 2 == 0 else write_ia3_adapter
        package = publisher.pack(
            writer(tiny_llama, root / "peft" / name, seed=seed), tiny_llama, root / f"{name}.expert", name
        )
        entry, _ = store.install(
            package, Keyring.from_dir(publisher.trusted), BaseModelIdentity.from_dir(tiny_llama)
        )
        planned[name] = common_pb2.PlannedExpert(
            name=name,
            version=entry.version,
            adapter_type=entry.manifest.adapter_type,
            weight=1.0,
            score=1.0 - seed / 10,
            vram_bytes=entry.weight_bytes,
            content_hash=entry.content_hash,
        )
    return publisher, store, planned


def _scenario(tiny_llama, installed, check, *, max_hot: int = 20) -> None:
    publisher, store, planned = installed

    async def main():
        engine = AsyncLLMEngine.from_pretrained(
            str(tiny_llama), max_model_len=256, num_blocks=64, trusted_keys_dir=str(publisher.trusted)
        )
        await engine.start()
        servicer = EngineServicer(engine, shared_metrics(EngineMetrics), 1 << 30)

        def register(server: grpc.aio.Server) -> list[str]:
            engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
            return ["expert.v1.EngineService"]

        metrics = shared_metrics(PreparationMetrics)
        stager = Stager(store, metrics, chunk_bytes=4096, max_hot=max_hot)
        try:
            async with serving(register, error_mapper=map_error) as target:
                fleet = Fleet(60.0)
                fleet.register(
                    common_pb2.EngineInfo(
                        engine_id="e1",
                        address=target,
                        model=model_spec(engine),
                        load=engine_load(engine),
                        experts=expert_holdings(await engine.expert_holdings()),
                    )
                )
                await check(fleet, Preparer(fleet, stager, metrics), stager, planned, engine)
        finally:
            await stager.close()
            await engine.shutdown()

    asyncio.run(main())


def _plan(*experts: common_pb2.PlannedExpert) -> common_pb2.ExpertPlan:
    return common_pb2.ExpertPlan(
        experts=experts,
        generation_params=common_pb2.GenerationParams(max_tokens=8),
        prompt_bytes=16,
    )


def test_a_cold_expert_is_sent_once_and_then_found_hot(tiny_llama, installed):
    async def check(fleet, preparer, stager, planned, engine):
        first = await preparer.prepare("job-1", _plan(planned["alpha"], planned["beta"]))
        assert first.staged_bytes > 0 and list(first.staged_experts) == ["alpha", "beta"]
        held = {e.name: e for e in (await engine.expert_holdings()).experts}
        assert set(held) == {"alpha", "beta"} and held["alpha"].content_hash == planned["alpha"].content_hash
        second = await preparer.prepare("job-2", _plan(planned["alpha"], planned["beta"]))
        assert second.staged_bytes == 0 and list(second.hot_experts) == ["alpha", "beta"]
        assert fleet.engines["e1"].references() == {"alpha@1.0.0": 2, "beta@1.0.0": 2}

    _scenario(tiny_llama, installed, check)


def test_concurrent_jobs_needing_the_same_cold_expert_send_it_once(tiny_llama, installed):
    async def check(fleet, preparer, stager, planned, engine):
        placements = await asyncio.gather(
            *(preparer.prepare(f"job-{i}", _plan(planned["gamma"])) for i in range(4))
        )
        assert sum(p.staged_bytes for p in placements) == placements[0].staged_bytes > 0
        assert sorted(len(p.hot_experts) for p in placements) == [0, 1, 1, 1]

    _scenario(tiny_llama, installed, check)


def test_room_is_made_by_unloading_the_least_recently_used_unreferenced_expert(tiny_llama, installed):
    async def check(fleet, preparer, stager, planned, engine):
        await preparer.prepare("uses-alpha", _plan(planned["alpha"]))  # stays placed: alpha is referenced
        await preparer.prepare("uses-beta", _plan(planned["beta"]))
        fleet.release("uses-beta")  # beta is idle now
        placement = await preparer.prepare("uses-gamma", _plan(planned["gamma"]))
        assert "preparation: unloaded beta@1.0.0 from e1 (least recently used)" in placement.trace
        assert {e.name for e in (await engine.expert_holdings()).experts} == {"alpha", "gamma"}
        assert set(fleet.engines["e1"].held()) == {expert_key("alpha", "1.0.0"), expert_key("gamma", "1.0.0")}

    _scenario(tiny_llama, installed, check, max_hot=2)


def test_an_expert_missing_from_the_store_is_dropped_and_a_forced_one_refuses_the_job(tiny_llama, installed):
    async def check(fleet, preparer, stager, planned, engine):
        missing = common_pb2.PlannedExpert()
        missing.CopyFrom(planned["alpha"])
        missing.name, missing.content_hash = "ghost", "0" * 64
        placement = await preparer.prepare("job-1", _plan(missing, planned["beta"]))
        assert list(placement.dropped_experts) == ["ghost"] and [e.name for e in placement.experts] == [
            "beta"
        ]
        assert any("ghost" in line and "not in the expert store" in line for line in placement.trace)
        missing.forced = True
        with pytest.raises(ServiceError) as refused:
            await preparer.prepare("job-2", _plan(missing))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "job-2" not in fleet.jobs  # the reservation was given back

    _scenario(tiny_llama, installed, check)


def test_holdings_reports_older_than_the_last_applied_are_ignored(tiny_llama, installed):
    async def check(fleet, preparer, stager, planned, engine):
        stale = fleet.engines["e1"].holdings.__deepcopy__()
        await preparer.prepare("job-1", _plan(planned["alpha"]))
        assert not fleet.engines["e1"].apply_holdings(stale)
        assert expert_key("alpha", "1.0.0") in fleet.engines["e1"].held()
        fleet.heartbeat("e1", engine_load(engine), expert_holdings(await engine.expert_holdings()))
        assert expert_key("alpha", "1.0.0") in fleet.engines["e1"].held()

    _scenario(tiny_llama, installed, check)


def test_an_engine_that_does_not_answer_a_staging_call_is_dropped_at_once(tiny_llama, installed):
    """Its process is gone (nothing listens at its address): the job gets UNAVAILABLE (it waits for
    an engine) and no later job is placed there before its next missed heartbeat would drop it."""

    async def check(fleet, preparer, stager, planned, engine):
        info = common_pb2.EngineInfo()
        info.CopyFrom(fleet.engines.pop("e1").info)
        info.engine_id, info.address, info.instance_id = "dead", f"127.0.0.1:{free_port()}", "p1"
        fleet.register(info)
        with pytest.raises(ServiceError) as refused:
            await preparer.prepare("job", _plan(planned["alpha"]))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert fleet.engines == {} and fleet.jobs == {}

    _scenario(tiny_llama, installed, check)


def test_the_engine_process_a_job_lost_is_dropped_and_its_restart_is_not(tiny_llama, installed):
    async def check(fleet, preparer, stager, planned, engine):
        info = common_pb2.EngineInfo()
        info.CopyFrom(fleet.engines["e1"].info)
        info.instance_id = "restarted"
        fleet.register(info)  # the engine's new process registered before the job asked again
        lost = [preparation_pb2.LostEngine(engine_id="e1", instance_id="dead")]
        placement = await preparer.prepare("job", _plan(), lost=lost)
        assert (placement.engine_id, placement.engine_instance_id) == ("e1", "restarted")
        fleet.release("job")
        lost = [preparation_pb2.LostEngine(engine_id="e1", instance_id="restarted")]
        with pytest.raises(ServiceError) as refused:
            await preparer.prepare("job", _plan(), lost=lost)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # none left: the job waits
        assert fleet.engines == {}

    _scenario(tiny_llama, installed, check)
