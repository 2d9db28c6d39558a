"""The engine service's finished-request counter against a real engine (the tiny model) behind a real
EngineService on a local port: every Generate call counts once under its finish reason, calls the
client cancelled mid-stream and calls past their deadline (both aborts) included."""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import REGISTRY

from libs.engine.async_engine import AsyncLLMEngine
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.__main__ import map_error
from services.engine.metrics import EngineMetrics
from services.engine.server import EngineServicer
from tests.helpers.in_process import serving, shared_metrics

CANCELLED = 5
# Greedy on the tiny model, this prompt runs for hundreds of tokens before its end-of-turn token.
PROMPT = "Expert systems route"


def _finished(reason: str) -> float:
    value = REGISTRY.get_sample_value("expert_engine_request_success_total", {"finished_reason": reason})
    return value or 0.0


def _request(max_tokens: int, deadline: Timestamp | None = None) -> engine_pb2.GenerateRequest:
    request = engine_pb2.GenerateRequest(
        input=common_pb2.ModelInput(text=PROMPT), params=common_pb2.GenerationParams(max_tokens=max_tokens)
    )
    if deadline is not None:
        request.deadline.CopyFrom(deadline)
    return request


def test_cancelled_and_expired_generate_calls_each_count_once_as_aborts(tiny_llama):
    async def main():
        engine = AsyncLLMEngine.from_pretrained(str(tiny_llama), max_model_len=1024, num_blocks=512)
        await engine.start()
        servicer = EngineServicer(engine, shared_metrics(EngineMetrics), 1 << 30)

        def register(server: grpc.aio.Server) -> list[str]:
            engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
            return ["expert.v1.EngineService"]

        reasons = ("abort", "stop", "length")
        before = {reason: _finished(reason) for reason in reasons}
        engine_aborts = engine.get_stats().requests_finished_total.get("abort", 0)
        try:
            async with (
                serving(register, error_mapper=map_error) as target,
                grpc.aio.insecure_channel(target) as channel,
            ):
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                calls = [stub.Generate(_request(1000)) for _ in range(CANCELLED)]
                for call in calls:
                    first = await call.read()  # generating: a first piece, not the end
                    assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
                for call in calls:
                    call.cancel()
                past = Timestamp()
                past.FromNanoseconds(time.time_ns() - 1_000_000_000)
                expired = [r async for r in stub.Generate(_request(1000, deadline=past))]
                assert expired[-1].finish_reason == common_pb2.FINISH_REASON_TIMEOUT
                done = [r async for r in stub.Generate(_request(4))]
                assert done[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

                aborted = CANCELLED + 1
                waited = time.monotonic()
                while _finished("abort") - before["abort"] < aborted and time.monotonic() - waited < 10:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)  # and nothing comes twice
            # Counted before shutdown, which would end any request left running as an abort too.
            counted = {reason: _finished(reason) - before[reason] for reason in reasons}
            assert counted == {"abort": aborted, "stop": 0, "length": 1}
            stats = engine.get_stats()
            assert stats.requests_finished_total["abort"] - engine_aborts == aborted
            assert stats.num_running == stats.num_waiting == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())
