"""n choices and token logprobs through a real EngineService (the tiny model, on a local port): a
seeded n = 2 request streams two different, reproducible sequences, each ending with its own
finish_reason, the usage once at the very end; greedy logprobs are transformers' log_softmax."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from libs.engine.async_engine import AsyncLLMEngine
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.__main__ import map_error
from services.engine.metrics import EngineMetrics
from services.engine.server import EngineServicer
from tests.helpers.in_process import serving, shared_metrics
from tests.helpers.reference import hf_greedy, load_hf

PROMPT = "Expert systems route"
MAX_TOKENS = 6


def _request(**params) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        input=common_pb2.ModelInput(text=PROMPT),
        params=common_pb2.GenerationParams(max_tokens=MAX_TOKENS, **params),
    )


@pytest.fixture(scope="module")
def generate(tiny_llama):
    """Runs GenerateRequests against one engine service; returns each call's messages."""

    def run(*requests: engine_pb2.GenerateRequest) -> tuple[list[list[engine_pb2.GenerateResponse]], object]:
        async def main():
            engine = AsyncLLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=128)
            await engine.start()
            servicer = EngineServicer(engine, shared_metrics(EngineMetrics), 1 << 30)

            def register(server: grpc.aio.Server) -> list[str]:
                engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
                return ["expert.v1.EngineService"]

            try:
                async with (
                    serving(register, error_mapper=map_error) as target,
                    grpc.aio.insecure_channel(target) as channel,
                ):
                    stub = engine_pb2_grpc.EngineServiceStub(channel)
                    return [
                        [r async for r in stub.Generate(request)] for request in requests
                    ], engine.tokenizer
            finally:
                await engine.shutdown()

        return asyncio.run(main())

    return run


def _by_choice(messages: list[engine_pb2.GenerateResponse]) -> dict[int, list[engine_pb2.GenerateResponse]]:
    choices: dict[int, list[engine_pb2.GenerateResponse]] = {}
    for m in messages:
        choices.setdefault(m.index, []).append(m)
    return choices


def test_a_seeded_request_with_n_2_streams_two_reproducible_choices(generate):
    request = _request(temperature=1.0, seed=7, n=2, logprobs=3)
    (first, again), _ = generate(request, request)
    choices = _by_choice(first)
    assert sorted(choices) == [0, 1]
    tokens = {}
    for index, messages in choices.items():
        ends = [m for m in messages if m.finish_reason]
        assert [m.finish_reason for m in ends] == [common_pb2.FINISH_REASON_LENGTH]
        assert ends[0] is messages[-1]  # nothing of a choice after its end
        tokens[index] = [t for m in messages for t in m.token_ids]
        logprobs = [lp for m in messages for lp in m.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens[index]  # one per token, in order
        for lp in logprobs:
            assert len(lp.top_logprobs) == 3 and lp.logprob <= 0.0
            ranked = [t.logprob for t in lp.top_logprobs]
            assert ranked == sorted(ranked, reverse=True) and lp.logprob <= ranked[0] + 1e-6
            assert lp.token_bytes  # the tiny tokenizer's tokens all add bytes
        assert len(tokens[index]) == MAX_TOKENS
    assert tokens[0] != tokens[1]  # a seeded n > 1 request seeds each choice differently
    # The usage comes once, on the very last message, counting both choices.
    assert [m.HasField("usage") for m in first] == [False] * (len(first) - 1) + [True]
    assert first[-1].usage.completion_tokens == 2 * MAX_TOKENS
    assert {i: [t for m in ms for t in m.token_ids] for i, ms in _by_choice(again).items()} == tokens


def test_greedy_logprobs_are_the_models_log_softmax(generate, tiny_llama):
    (messages,), tokenizer = generate(_request(temperature=0.0, logprobs=2))
    logprobs = [lp for m in messages for lp in m.logprobs]
    prompt_ids = tokenizer.encode(PROMPT)
    expected_tokens, logits = hf_greedy(load_hf(tiny_llama), prompt_ids, len(logprobs))
    assert [lp.token_id for lp in logprobs] == expected_tokens
    for lp, step in zip(logprobs, logits, strict=True):
        reference = torch.log_softmax(step, dim=-1)
        assert lp.logprob == pytest.approx(reference[lp.token_id].item(), abs=1e-3)
        best = torch.topk(reference, 2)
        assert [t.token_id for t in lp.top_logprobs] == best.indices.tolist()
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-3)
        assert lp.token == tokenizer.decode([lp.token_id], skip_special_tokens=False)
