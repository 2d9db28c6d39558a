"""The SDK's sessions (`ExpertClient.session`, `AsyncExpertClient.session`) against a real stack on the
tiny model: turns streamed and summed up in their end, a cut reply continued, cancel, end, and the
refusals as the SDK's exceptions."""

from __future__ import annotations

import asyncio
import threading

import pytest

from expert_system import (
    AsyncExpertClient,
    ExpertClient,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    SessionInfo,
    StreamChunk,
    TurnEnd,
)

MAX_NEW = 8
# A format that allows no end before 300 tokens: the turn runs until it is cut or cancelled.
ENDLESS = "(ab ){300}"


@pytest.fixture(scope="module")
def stack(shared_tiny_stack):
    return shared_tiny_stack  # it only sends requests: the session's shared stack serves


@pytest.fixture(scope="module")
def client(stack):
    with ExpertClient(stack.target("reception")) as client:
        yield client


def _turn(session, text: str, **fields) -> tuple[list[StreamChunk], TurnEnd]:
    session.append(text)
    stream = session.generate(**fields)
    chunks = list(stream)
    assert stream.end is not None and stream.job_id == stream.end.job_id
    return chunks, stream.end


def test_a_session_streams_two_turns_and_ends_on_leaving_the_block(client):
    with client.session(
        system_prompt="You answer briefly.", temperature=0.0, max_new_tokens=MAX_NEW
    ) as session:
        assert session.cancel() is False  # nothing runs yet
        appended = session.append("what is two plus two?")
        assert isinstance(appended, SessionInfo) and appended.session_id == session.session_id
        assert (appended.state, appended.pending_messages, appended.turns) == ("idle", 1, 0)
        stream = session.generate()
        chunks = list(stream)
        first = stream.end
        assert chunks and not any(c.restarted for c in chunks)
        assert "".join(c.text for c in chunks) == first.text
        assert first.finish_reason in ("stop", "length") and not first.error
        assert 0 < first.usage.completion_tokens <= MAX_NEW and first.usage.prompt_tokens > 0
        assert first.session.turns == 1 and first.session.state == "idle"

        chunks, second = _turn(session, "and three plus three?", max_new_tokens=3)  # a turn's override
        assert "".join(c.text for c in chunks) == second.text
        assert second.usage.completion_tokens <= 3
        # The history stayed on the engine: only the new message (and the last reply's final token)
        # is computed.
        assert second.usage.prompt_tokens > first.session.tokens
        assert 0 < second.usage.cached_tokens <= first.session.tokens

        info = session.info()
        assert info.turns == 2 and info.state == "idle" and info.engine_id
        assert info.tokens == second.session.tokens and info.last_finish_reason == second.finish_reason
        assert info.created_at is not None and info.expires_at > info.created_at
        assert session.cancel() is False
    with pytest.raises(NotFound):
        session.info()
    with pytest.raises(NotFound):
        session.append("still there?")


def test_a_cut_reply_goes_on_and_a_running_turn_is_cancelled(client):
    with client.session(temperature=0.0) as session:
        with pytest.raises(FailedPrecondition):  # nothing to answer yet
            list(session.generate())
        _, cut = _turn(session, "write a long story", max_new_tokens=4, regex=ENDLESS)
        assert cut.finish_reason == "length" and cut.usage.completion_tokens == 4
        # Nothing appended: the reply goes on from where it was cut, computing only its last token.
        stream = session.generate(max_new_tokens=4, regex=ENDLESS)
        chunks = list(stream)
        assert stream.end.usage.prompt_tokens == cut.session.tokens
        assert stream.end.usage.prompt_tokens - stream.end.usage.cached_tokens == 1
        assert "".join(c.text for c in chunks) == stream.end.text

        session.append("and another one")
        stream = session.generate(max_new_tokens=400, regex=ENDLESS)
        first_chunk = threading.Event()

        def read() -> None:
            for _ in stream:
                first_chunk.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first_chunk.wait(30)
        assert session.cancel() is True
        reader.join(timeout=30)
        assert stream.end.finish_reason == "abort"
        info = session.info()
        assert info.state == "idle" and info.last_finish_reason == "abort" and info.turns == 3
        ended = session.end()
    assert ended.state == "ended" and ended.turns == 3


def test_refusals_are_the_sdks_exceptions(client):
    with pytest.raises(InvalidRequest) as refused:
        client.session(temperature=7.0)
    assert any(field == "sampling.temperature" for field, _ in refused.value.field_violations)
    with pytest.raises(TypeError, match="max_tokens"):
        client.session(max_tokens=5)  # the session's name is max_new_tokens
    session = client.session(max_new_tokens=MAX_NEW)
    with pytest.raises(InvalidRequest):
        session.append([{"role": "assistant", "content": "not a role to append"}])
    session.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert session.end().state == "ended"
    with pytest.raises(NotFound):
        session.append("after the end")
    with pytest.raises(NotFound):
        list(session.generate())
    with session:  # leaving the block of an ended session is fine
        pass


def test_the_async_client_takes_turns_the_same_way(stack):
    async def run():
        async with AsyncExpertClient(stack.target("reception")) as client:
            async with client.session(temperature=0.0, max_new_tokens=MAX_NEW) as session:
                assert await session.cancel() is False
                ends = []
                for text in ("hello", "hello again"):
                    await session.append(text)
                    stream = session.generate()
                    chunks = [chunk async for chunk in stream]
                    assert "".join(c.text for c in chunks) == stream.end.text
                    ends.append(stream.end)
                info = await session.info()
            with pytest.raises(NotFound):
                await session.append("after the end")
            other = await client.session(max_new_tokens=MAX_NEW)
            ended = await other.end()
            return ends, info, ended

    ends, info, ended = asyncio.run(run())
    assert [end.session.turns for end in ends] == [1, 2]
    assert ends[1].usage.cached_tokens > 0
    assert info.turns == 2 and info.state == "idle"
    assert ended.state == "ended" and ended.turns == 0
