"""The engine's membership in the fleet under a long model step: a real engine (tiny model) whose
step is made to take 3 s (as a long prefill under load does), heartbeating a real preparation over
gRPC with a 1 s heartbeat timeout. The heartbeat never waits for the step, so the engine is never
dropped, and the jobs placed on it stay counted."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from libs.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from libs.gen.expert.v1 import common_pb2, preparation_pb2, preparation_pb2_grpc
from services.engine.registration import Membership
from services.preparation.server import PreparationServicer
from tests.helpers.in_process import preparation_parts, serving

STEP_S = 3.0
HEARTBEAT_TIMEOUT_S = 1.0


def _slow_first_step(engine: LLMEngine, entered: threading.Event) -> None:
    """Fault injection: the first step that runs the model sleeps STEP_S on the engine thread."""
    step = engine.step
    slowed = False

    def slow_step():
        nonlocal slowed
        if not slowed and engine.has_unfinished_requests():
            slowed = True
            entered.set()
            time.sleep(STEP_S)
        return step()

    engine.step = slow_step


def test_a_long_engine_step_does_not_cost_the_engine_its_place_in_the_fleet(tiny_llama, tmp_path):
    async def main():
        fleet, preparer, metrics = preparation_parts(tmp_path, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        preparation = PreparationServicer(fleet, preparer, metrics, 0.2)
        sync = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=1024, num_blocks=200)
        entered = threading.Event()
        _slow_first_step(sync, entered)
        engine = AsyncLLMEngine(sync)
        await engine.start()

        def register(server: grpc.aio.Server) -> list[str]:
            preparation_pb2_grpc.add_PreparationServiceServicer_to_server(preparation, server)
            return ["expert.v1.PreparationService"]

        dropped: list[str] = []
        async with serving(register) as target, grpc.aio.insecure_channel(target) as channel:
            stub = preparation_pb2_grpc.PreparationServiceStub(channel)
            membership = Membership(engine, "e1", "127.0.0.1:1", stub, interval_s=0.2)
            beating = asyncio.create_task(membership.run())
            await asyncio.wait_for(membership.registered.wait(), 10)
            plan = preparation_pb2.PrepareRequest(job_id="placed", plan=_plan())
            await stub.Prepare(plan)  # a job placed on e1 before the long step

            async def generate():
                async for _ in engine.generate("Hello", SamplingParams(max_tokens=4)):
                    pass

            generating = asyncio.create_task(generate())
            await asyncio.to_thread(entered.wait, 10)
            started = time.monotonic()
            while time.monotonic() - started < STEP_S - 0.2:  # preparation's sweep, during the step
                dropped += [e.engine_id for e in fleet.expire()]
                await asyncio.sleep(0.1)
            assert not generating.done()  # the step was still running all along
            await asyncio.wait_for(generating, 30)
            beating.cancel()
        await engine.shutdown()
        assert dropped == []
        assert list(fleet.engines) == ["e1"] and list(fleet.engines["e1"].jobs) == ["placed"]

    asyncio.run(main())


def _plan() -> common_pb2.ExpertPlan:
    return common_pb2.ExpertPlan(prompt_bytes=10, generation_params=common_pb2.GenerationParams(max_tokens=6))
