"""AsyncLLMEngine on a tiny real model: concurrent streams equal the sync engine, leaving a stream or
aborting ends the request and frees its blocks, shutdown aborts what is open, the loop stays free."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import time

import pytest

from libs.engine import (
    AsyncLLMEngine,
    InvalidRequestError,
    LLMEngine,
    OutputKind,
    SamplingParams,
    SchedulerConfig,
)
from libs.experts.manifest import BaseModelIdentity

MAX_MODEL_LEN = 1024
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def sync_engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_blocks=300)


@pytest.fixture
def engine(tiny_llama) -> AsyncLLMEngine:
    """A fresh async engine per test (not started: tests start it on their own event loop)."""
    return AsyncLLMEngine.from_pretrained(str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_blocks=300)


async def collect(stream) -> list:
    return [out async for out in stream]


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def idle(engine: AsyncLLMEngine) -> bool:
    stats = engine.get_stats()
    return stats.num_running == stats.num_waiting == 0 and stats.kv_used_blocks == 0


def test_concurrent_streams_give_the_sync_engine_results(engine, sync_engine):
    prompts = ["Hello", "def add(a, b):", [5, 6, 7, 8], "SELECT name"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=OutputKind.DELTA),
    ]

    async def main():
        await engine.start()
        try:
            streams = [engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
            return await asyncio.gather(*(collect(s) for s in streams))
        finally:
            await engine.shutdown()

    streams = asyncio.run(main())
    expected = sync_engine.generate(prompts, params)
    for outputs in streams:
        assert len(outputs) > 1
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        final = outputs[-1]
        assert final.finish_reason == "length"
    for outputs, reference in zip(streams[:3], expected[:3], strict=True):
        assert outputs[-1].token_ids == reference.token_ids and outputs[-1].text == reference.text
    deltas = streams[3]
    assert [t for o in deltas for t in o.token_ids] == expected[3].token_ids
    assert "".join(o.text for o in deltas) == expected[3].text


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(engine):
    async def main():
        await engine.start()
        try:
            received = 0
            async for _ in engine.generate("Hello", LONG, request_id="left"):
                received += 1
                if received == 3:
                    break
            await wait_for(lambda: idle(engine) and engine.get_stats().requests_finished_total)
            return engine.get_stats()
        finally:
            await engine.shutdown()

    stats = asyncio.run(main())
    assert stats.requests_finished_total == {"abort": 1}
    assert stats.kv_free_blocks + stats.kv_cached_blocks == stats.kv_num_blocks
    after = engine.engine.get_stats()
    assert after.kv_used_blocks == 0 and after.requests_finished_total == {"abort": 1}


def test_cancelling_the_consumer_aborts_the_request(engine):
    async def main():
        await engine.start()
        try:
            first = asyncio.Event()

            async def consume():
                async for _ in engine.generate("Hello", LONG):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for(lambda: idle(engine) and engine.get_stats().requests_finished_total)
            return engine.get_stats()
        finally:
            await engine.shutdown()

    assert asyncio.run(main()).requests_finished_total == {"abort": 1}


def test_a_stream_interval_delivers_every_n_tokens_merged_and_the_rest_at_the_end(engine, sync_engine):
    delta = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=OutputKind.DELTA)
    cumulative = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def main():
        await engine.start()
        try:
            by_four = await collect(engine.add_request("d", "Hello", delta, stream_interval=4))
            whole = await collect(engine.add_request("c", "Hello", cumulative, stream_interval=4))
            return by_four, whole
        finally:
            await engine.shutdown()

    by_four, whole = asyncio.run(main())
    reference = sync_engine.generate(["Hello"], [cumulative])[0]
    assert [len(o.token_ids) for o in by_four] == [4, 4, 2]
    assert [o.finished for o in by_four] == [False, False, True]
    assert [t for o in by_four for t in o.token_ids] == reference.token_ids
    assert "".join(o.text for o in by_four) == reference.text
    assert [len(o.token_ids) for o in whole] == [4, 8, 10] and whole[-1].text == reference.text


def test_an_abort_delivers_the_tokens_held_back_by_a_stream_interval(engine):
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        await engine.start()
        try:
            stream = engine.add_request("held", "Hello", params, stream_interval=10_000)
            await wait_for(lambda: engine.get_stats().num_running == 1)
            await asyncio.sleep(0.2)  # some tokens are made, none delivered
            engine.abort("held")
            return await asyncio.wait_for(collect(stream), timeout=10)
        finally:
            await engine.shutdown()

    outputs = asyncio.run(main())
    assert len(outputs) == 1 and outputs[0].finish_reason == "abort"
    assert 0 < len(outputs[0].token_ids) < 900


def test_a_stream_interval_below_one_is_refused(engine):
    async def main():
        await engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="stream_interval"):
                engine.add_request("bad", "Hello", stream_interval=0)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_abort_ends_the_stream_with_finish_reason_abort(engine):
    async def main():
        await engine.start()
        try:
            outputs = []
            async for out in engine.generate("Hello", LONG, request_id="to-abort"):
                outputs.append(out)
                if len(outputs) == 2:
                    engine.abort("to-abort")
            return outputs
        finally:
            await engine.shutdown()

    outputs = asyncio.run(main())
    final = outputs[-1]
    assert final.finished and final.finish_reason == "abort"
    assert 2 <= len(final.token_ids) < LONG.max_tokens
    assert all(not o.finished for o in outputs[:-1])
    assert engine.engine.get_stats().kv_used_blocks == 0


def test_an_abort_right_after_adding_ends_the_stream_at_once(engine):
    async def main():
        await engine.start()
        try:
            stream = engine.add_request("instant", "Hello", LONG)
            engine.abort("instant")
            return await asyncio.wait_for(collect(stream), timeout=10)
        finally:
            await engine.shutdown()

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < LONG.max_tokens


def test_aborting_an_unknown_request_is_a_no_op(engine):
    async def main():
        await engine.start()
        try:
            engine.abort("nobody")
            return await collect(engine.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True)))
        finally:
            await engine.shutdown()

    assert asyncio.run(main())[-1].finish_reason == "length"


def test_on_finished_sees_each_finished_request_once_read_or_not(engine):
    finished = []

    async def main():
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            short = engine.add_request("read", "Hello", params, on_finished=finished.append)
            await collect(short)
            engine.add_request("unread", "Hello", LONG, on_finished=finished.append)  # never read
            engine.abort("unread")
            await wait_for(lambda: len(finished) == 2 and idle(engine))
            await asyncio.sleep(0.2)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert [(o.request_id, o.finish_reason, o.finished) for o in finished] == [
        ("read", "length", True),
        ("unread", "abort", True),
    ]


def test_invalid_input_is_refused_when_the_request_is_added(engine):
    async def main():
        await engine.start()
        try:
            with pytest.raises(InvalidRequestError) as empty:
                engine.add_request("bad", "", SamplingParams())
            with pytest.raises(InvalidRequestError) as too_long:
                engine.add_request("bad", [5] * MAX_MODEL_LEN, SamplingParams())
            with pytest.raises(InvalidRequestError) as from_generate:
                await collect(engine.generate([{"role": "wizard", "content": "x"}]))
            return empty.value.field, too_long.value.field, from_generate.value.field
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == ("prompt", "prompt", "messages[0].role")
    assert not engine.engine.has_unfinished_requests()


def test_a_duplicate_request_id_is_refused(engine):
    async def main():
        await engine.start()
        try:
            stream = engine.add_request("same", "Hello", LONG)
            with pytest.raises(InvalidRequestError) as info:
                engine.add_request("same", "World", LONG)
            engine.abort("same")
            outputs = await collect(stream)
            return info.value.field, outputs[-1].finish_reason
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == ("request_id", "abort")


def test_adding_a_request_before_start_is_an_error(engine):
    with pytest.raises(RuntimeError, match="start"):
        engine.add_request("early", "Hello")


def test_shutdown_ends_open_streams_with_abort(engine):
    async def main():
        await engine.start()
        started = [asyncio.Event(), asyncio.Event()]

        async def consume(i: int):
            outputs = []
            async for out in engine.generate(f"Hello {i}", LONG):
                outputs.append(out)
                started[i].set()
            return outputs

        tasks = [asyncio.create_task(consume(i)) for i in range(2)]
        for event in started:
            await event.wait()
        await engine.shutdown()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    for outputs in asyncio.run(main()):
        assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert not engine.is_running
    stats = engine.engine.get_stats()
    assert stats.kv_used_blocks == 0 and stats.requests_finished_total == {"abort": 2}


def test_the_event_loop_is_not_blocked_while_the_engine_computes(engine):
    async def main():
        await engine.start()
        try:
            ticks: list[float] = []
            running = True

            async def ticker():
                while running:
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.01)

            task = asyncio.create_task(ticker())
            started = time.monotonic()
            while time.monotonic() - started < 0.5:  # keep the engine busy for half a second at least
                await asyncio.gather(*(collect(engine.generate(f"Prompt {i}", LONG)) for i in range(4)))
            elapsed = time.monotonic() - started
            running = False
            await task
            return ticks, elapsed
        finally:
            await engine.shutdown()

    # What this measures is the engine thread; a full collection of the test process's heap (over a
    # thousand tests' objects by now) would pause both threads and is not the engine's doing.
    gc.collect()
    gc.freeze()
    try:
        ticks, elapsed = asyncio.run(main())
    finally:
        gc.unfreeze()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) >= 0.3 * elapsed / 0.01
    assert max(gaps) < 0.25


def test_stats_are_a_snapshot_taken_by_the_engine_thread(engine):
    async def main():
        await engine.start()
        try:
            await collect(engine.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True)))
            await wait_for(lambda: engine.get_stats().requests_finished_total)
            return engine.get_stats()
        finally:
            await engine.shutdown()

    stats = asyncio.run(main())
    assert stats.requests_finished_total == {"length": 1}
    assert stats.generation_tokens_total == 5


def test_the_model_info_describes_the_loaded_model_and_the_engines_limits(engine, tiny_llama):
    async def main():
        await engine.start()
        try:
            return engine.model_info
        finally:
            await engine.shutdown()

    info = asyncio.run(main())
    raw = json.loads((tiny_llama / "config.json").read_text())
    assert info.name == tiny_llama.name
    assert info.base_model == BaseModelIdentity.from_hf_config(raw)
    assert (info.num_layers, info.num_kv_heads) == (raw["num_hidden_layers"], raw["num_key_value_heads"])
    assert (info.dtype, info.dtype_bytes) == ("float32", 4)  # the CPU's default
    assert info.max_model_len == MAX_MODEL_LEN
    defaults = SchedulerConfig()
    assert (info.max_num_seqs, info.max_sessions) == (defaults.max_num_seqs, defaults.max_sessions)


def test_the_model_info_is_there_once_the_engine_is_built(engine):
    with pytest.raises(RuntimeError, match="start"):
        engine.model_info  # noqa: B018


def test_the_load_is_the_latest_snapshot_against_the_engines_limits(engine):
    async def main():
        await engine.start()
        try:
            engine.add_request("busy", "Hello", LONG)
            await wait_for(lambda: engine.load().running == 1)
            return engine.load(), engine.model_info
        finally:
            await engine.shutdown()

    load, info = asyncio.run(main())
    assert load.running == 1 and load.waiting == 0
    assert 0 < load.kv_blocks_free < load.kv_blocks_total
    assert (load.max_num_seqs, load.max_sessions) == (info.max_num_seqs, info.max_sessions)
