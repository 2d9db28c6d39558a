"""Sessions (docs/api.md#sessions) on a real stack on the tiny model: turns that compute only their
new tokens and answer what a stateless request with the whole history answers, cancel, end,
expiry, an engine lost between turns, 32 sessions at once, and every refusal."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest
import redis

from libs.engine import LLMEngine, OutputKind
from libs.gen.expert.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    session_state_pb2,
)
from services.engine.server import sampling_params
from services.reception.sessions import session_key
from tests.e2e.conftest import ready_tiny_stack

MAX_NEW = 8


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    with ready_tiny_stack(
        tiny_llama, tmp_path_factory.mktemp("sessions"), EXPERT_SESSION_MAX_TOKENS="600"
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def sessions(stack):
    with grpc.insecure_channel(stack.target("reception")) as channel:
        yield session_pb2_grpc.SessionServiceStub(channel)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLMEngine:
    """The stateless answer: the same model in process, prefix caching off, fed the whole history."""
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=1024, enable_prefix_caching=False)


def _record(stack, session_id: str) -> session_state_pb2.SessionRecord:
    client = redis.Redis.from_url(stack.redis_url)
    return session_state_pb2.SessionRecord.FromString(client.get(session_key(session_id)))


def _create(sessions, **settings) -> str:
    settings.setdefault("sampling", session_pb2.SessionSampling(temperature=0.0, max_new_tokens=MAX_NEW))
    return sessions.CreateSession(session_pb2.CreateSessionRequest(**settings)).session.session_id


def _generate(sessions, session_id: str, **fields) -> tuple[str, session_pb2.TurnEnd]:
    text, end = [], None
    for message in sessions.GenerateStream(
        session_pb2.GenerateStreamRequest(session_id=session_id, **fields)
    ):
        if message.HasField("end"):
            end = message.end
        elif message.WhichOneof("event") == "text":
            text.append(message.text)
    return "".join(text), end


def _turn(sessions, session_id: str, text: str, **fields):
    sessions.AppendInput(session_pb2.AppendInputRequest(session_id=session_id, text=text))
    return _generate(sessions, session_id, **fields)


def _stateless(reference: LLMEngine, record: session_state_pb2.SessionRecord, prompt: list[int]) -> list[int]:
    """The tokens a stateless request for `prompt` gets, with the sampling the session's plan fixed."""
    params = dataclasses.replace(
        sampling_params(record.plan.generation_params), output_kind=OutputKind.FINAL_ONLY
    )
    return list(reference.generate([prompt], params)[0].outputs[0].token_ids)


def _engine_load(stack, target: str | None = None) -> common_pb2.EngineLoad:
    with grpc.insecure_channel(target or stack.target("engine")) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest()).load


def test_ten_turns_compute_only_their_new_tokens_and_equal_stateless_requests(stack, sessions, reference):
    session_id = _create(sessions, system_prompt="You answer briefly.")
    history: list[int] = []
    for i in range(10):
        streamed, end = _turn(sessions, session_id, f"question {i}: what is {i} plus {i}?")
        assert end.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert streamed == end.text
        record = _record(stack, session_id)
        output = list(record.token_ids[len(record.token_ids) - end.usage.completion_tokens :])
        prompt = list(record.token_ids[: len(record.token_ids) - len(output)])
        assert prompt[: len(history)] == history
        assert _stateless(reference, record, prompt) == output  # the same tokens as a stateless request
        new = len(prompt) - len(history)
        computed = end.usage.prompt_tokens - end.usage.cached_tokens
        # The first turn computes its whole prompt; each later one its own tokens, plus the last
        # reply's final token (sampled, never yet read by the model).
        assert computed == (new if i == 0 else new + 1)
        assert end.session.turns == i + 1 and end.session.tokens == len(record.token_ids)
        history = list(record.token_ids)
    assert sessions.GetSession(session_pb2.GetSessionRequest(session_id=session_id)).session.state == (
        session_pb2.SESSION_STATE_IDLE
    )


def test_ending_a_session_returns_the_engine_kv_to_idle(stack, sessions):
    idle = _engine_load(stack)
    session_id = _create(sessions)
    for i in range(3):
        _turn(sessions, session_id, f"tell me about the number {i}")
    held = _engine_load(stack)
    assert held.sessions == idle.sessions + 1 and held.kv_blocks_sessions > idle.kv_blocks_sessions
    ended = sessions.EndSession(session_pb2.EndSessionRequest(session_id=session_id)).session
    assert ended.state == session_pb2.SESSION_STATE_ENDED and ended.turns == 3
    after = _engine_load(stack)
    assert (after.sessions, after.kv_blocks_sessions) == (idle.sessions, idle.kv_blocks_sessions)
    with pytest.raises(grpc.RpcError) as error:
        _turn(sessions, session_id, "still there?")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_cancelled_turn_keeps_its_text_and_the_next_turn_goes_on_from_it(stack, sessions, reference):
    session_id = _create(sessions)
    _turn(sessions, session_id, "first")
    sessions.AppendInput(session_pb2.AppendInputRequest(session_id=session_id, text="write a long story"))
    # A format that allows no end before 300 tokens keeps the turn running until it is cancelled.
    call = sessions.GenerateStream(
        session_pb2.GenerateStreamRequest(
            session_id=session_id,
            sampling=session_pb2.SessionSampling(max_new_tokens=400),
            response_format=common_pb2.ResponseFormat(regex="(ab ){300}"),
        )
    )
    received = []

    def read() -> None:
        for message in call:
            received.append(message)

    reader = threading.Thread(target=read)
    reader.start()
    while not received:
        time.sleep(0.01)
    cancelled = sessions.CancelGenerate(session_pb2.CancelGenerateRequest(session_id=session_id))
    reader.join(timeout=30)
    assert cancelled.cancelled and cancelled.session.state == session_pb2.SESSION_STATE_IDLE
    assert cancelled.session.last_finish_reason == common_pb2.FINISH_REASON_ABORT
    end = received[-1].end
    assert end.finish_reason == common_pb2.FINISH_REASON_ABORT
    kept = list(_record(stack, session_id).token_ids)
    # Nothing appended: the cut reply goes on from what was kept, computing only its last token.
    streamed, end = _generate(sessions, session_id)
    assert end.usage.prompt_tokens == len(kept) and end.usage.prompt_tokens - end.usage.cached_tokens == 1
    output = list(_record(stack, session_id).token_ids[len(kept) :])
    assert _stateless(reference, _record(stack, session_id), kept) == output
    assert streamed == end.text


def test_refusals_name_what_is_wrong(stack, sessions):
    def code(call, request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as error:
            result = call(request)
            if not isinstance(result, session_pb2.CreateSessionResponse | session_pb2.AppendInputResponse):
                list(result)
        return error.value.code(), error.value.details()

    unknown = "0" * 32
    assert code(sessions.AppendInput, session_pb2.AppendInputRequest(session_id=unknown, text="hi"))[0] == (
        grpc.StatusCode.NOT_FOUND
    )
    assert code(sessions.GenerateStream, session_pb2.GenerateStreamRequest(session_id=unknown))[0] == (
        grpc.StatusCode.NOT_FOUND
    )
    status, details = code(
        sessions.CreateSession,
        session_pb2.CreateSessionRequest(sampling=session_pb2.SessionSampling(temperature=7.0)),
    )
    assert status == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in details
    session_id = _create(sessions)
    status, details = code(sessions.GenerateStream, session_pb2.GenerateStreamRequest(session_id=session_id))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and "AppendInput first" in details
    # A second generation while one runs.
    sessions.AppendInput(session_pb2.AppendInputRequest(session_id=session_id, text="a long answer please"))
    first = sessions.GenerateStream(
        session_pb2.GenerateStreamRequest(
            session_id=session_id,
            sampling=session_pb2.SessionSampling(max_new_tokens=400),
            response_format=common_pb2.ResponseFormat(regex="(ab ){300}"),  # no early end
        )
    )
    next(iter(first))
    status, details = code(sessions.GenerateStream, session_pb2.GenerateStreamRequest(session_id=session_id))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and "is generating" in details
    first.cancel()
    # A session over EXPERT_SESSION_MAX_TOKENS (600 in this stack).
    long_id = _create(sessions)
    sessions.AppendInput(session_pb2.AppendInputRequest(session_id=long_id, text="word " * 700))
    status, details = code(sessions.GenerateStream, session_pb2.GenerateStreamRequest(session_id=long_id))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and "EXPERT_SESSION_MAX_TOKENS" in details


def test_thirty_two_sessions_at_once_keep_their_own_text(stack, sessions, reference):
    ids = [_create(sessions) for _ in range(32)]
    errors: list[BaseException] = []

    def talk(index: int, session_id: str) -> None:
        try:
            for turn in range(2):
                _turn(sessions, session_id, f"session {index} turn {turn}: " + "abc " * (index % 5))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(i, s)) for i, s in enumerate(ids)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors
    for index, session_id in enumerate(ids):
        record = _record(stack, session_id)
        assert record.turns == 2
        assert record.messages[-2].content.startswith(f"session {index} turn 1")
        # The last reply is what a stateless request with this session's own history answers.
        reply = record.last_usage.completion_tokens
        prompt, output = list(record.token_ids[:-reply]), list(record.token_ids[-reply:])
        assert _stateless(reference, record, prompt) == output
        sessions.EndSession(session_pb2.EndSessionRequest(session_id=session_id))


def test_an_engine_lost_between_turns_is_replaced_with_the_same_text(tiny_llama, tmp_path, reference):
    with ready_tiny_stack(tiny_llama, tmp_path) as stack:
        stack.start_engine("engine-b")
        with grpc.insecure_channel(stack.target("reception")) as channel:
            stub = session_pb2_grpc.SessionServiceStub(channel)
            session_id = _create(stub)
            _turn(stub, session_id, "hello there")
            pinned = _record(stack, session_id).engine_id
            victim = "engine" if pinned != "engine-b" else "engine-b"
            stack.kill(victim)
            _, end = _turn(stub, session_id, "and after the crash?")
            record = _record(stack, session_id)
            assert record.engine_id != pinned
            output = list(record.token_ids[len(record.token_ids) - end.usage.completion_tokens :])
            prompt = list(record.token_ids[: len(record.token_ids) - len(output)])
            assert _stateless(reference, record, prompt) == output
            assert end.usage.cached_tokens == 0  # the new engine recomputed the history


def test_idle_sessions_expire(tiny_llama, tmp_path):
    with (
        ready_tiny_stack(tiny_llama, tmp_path, EXPERT_SESSION_IDLE_SECONDS="2") as stack,
        grpc.insecure_channel(stack.target("reception")) as channel,
    ):
        stub = session_pb2_grpc.SessionServiceStub(channel)
        session_id = _create(stub)
        _turn(stub, session_id, "hello")
        assert _engine_load(stack).sessions == 1
        time.sleep(4.0)
        with pytest.raises(grpc.RpcError) as error:
            stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        load = _engine_load(stack)
        assert load.sessions == 0 and load.kv_blocks_sessions == 0


def test_sessions_over_the_engine_limit_are_refused(tiny_llama, tmp_path):
    with (
        ready_tiny_stack(tiny_llama, tmp_path, EXPERT_MAX_SESSIONS="1") as stack,
        grpc.insecure_channel(stack.target("reception")) as channel,
    ):
        stub = session_pb2_grpc.SessionServiceStub(channel)
        _turn(stub, _create(stub), "the first session")
        with pytest.raises(grpc.RpcError) as error:
            _turn(stub, _create(stub), "a second one")
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "EXPERT_MAX_SESSIONS=1" in error.value.details()


def test_a_client_reading_too_slowly_has_its_turn_stopped_and_keeps_its_session(tiny_llama, tmp_path):
    # The client's receive window is kept small, so the server's writes wait on it as soon as it
    # stops reading (the default 64 KiB window, grown by BDP probes, would hold a whole reply).
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with (
        ready_tiny_stack(tiny_llama, tmp_path, EXPERT_SESSION_STREAM_BUFFER="4") as stack,
        grpc.insecure_channel(stack.target("reception"), options=options) as channel,
    ):
        stub = session_pb2_grpc.SessionServiceStub(channel)
        session_id = _create(stub)
        stub.AppendInput(session_pb2.AppendInputRequest(session_id=session_id, text="go on and on"))
        call = stub.GenerateStream(
            session_pb2.GenerateStreamRequest(
                session_id=session_id,
                sampling=session_pb2.SessionSampling(max_new_tokens=600),
                response_format=common_pb2.ResponseFormat(regex="(abc def ){280}"),  # no early end
            )
        )
        deadline = time.monotonic() + 60
        state = session_pb2.SESSION_STATE_GENERATING
        while state == session_pb2.SESSION_STATE_GENERATING and time.monotonic() < deadline:
            time.sleep(0.2)  # not reading
            state = stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id)).session.state
        session = stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id)).session
        assert session.state == session_pb2.SESSION_STATE_IDLE
        assert session.last_finish_reason == common_pb2.FINISH_REASON_ABORT
        with pytest.raises(grpc.RpcError) as error:
            list(call)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "EXPERT_SESSION_STREAM_BUFFER" in error.value.details()
        # The session is usable: the cut reply goes on where it stopped.
        _, end = _generate(stub, session_id)
        assert end.session.turns == 2


def test_a_tiny_kv_pool_evicts_idle_sessions_and_they_recompute_the_same_text(
    tiny_llama, tmp_path, reference
):
    # 40 blocks of 16 tokens: four conversations of ~150 tokens each cannot all stay.
    with (
        ready_tiny_stack(tiny_llama, tmp_path, EXPERT_KV_NUM_BLOCKS="40") as stack,
        grpc.insecure_channel(stack.target("reception")) as channel,
    ):
        stub = session_pb2_grpc.SessionServiceStub(channel)
        ids = [_create(stub) for _ in range(4)]
        for round_ in range(3):
            for index, session_id in enumerate(ids):
                _, end = _turn(stub, session_id, f"conversation {index}, round {round_}: " + "word " * 30)
                record = _record(stack, session_id)
                output = list(record.token_ids[len(record.token_ids) - end.usage.completion_tokens :])
                prompt = list(record.token_ids[: len(record.token_ids) - len(output)])
                assert _stateless(reference, record, prompt) == output
        with grpc.insecure_channel(stack.target("engine")) as engine_channel:
            stats = engine_pb2_grpc.EngineServiceStub(engine_channel).GetStats(engine_pb2.GetStatsRequest())
        assert stats.session_evictions_total > 0 and stats.session_recomputes_total > 0
        assert stats.preemptions_total == 0  # idle sessions went first
