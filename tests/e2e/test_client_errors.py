"""A client's error is never an engine's failure (issue 48), on real processes: a stack on the tiny
model gets requests holding text no tokenizer can take (a lone surrogate, sent as JSON escapes it,
in a call's arguments, a Responses function_call item, the deprecated function_call, a tool's name
or description) beside six ordinary jobs. Each bad one is a 400 naming its field, the engine is
never dropped (preparation lists the same registration throughout and never logged a drop), the
six finish, and every reservation comes back. The engine itself, asked directly, answers such a
request INVALID_ARGUMENT; a job carrying it past reception fails with that error, engine kept."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from redis.asyncio import Redis

from libs.errors import field_violations
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc, preparation_pb2, preparation_pb2_grpc
from services.reception.jobs import JobStore
from services.reception.queue import stream
from tests.e2e.conftest import TINY_SETTINGS, ready_tiny_stack, wait_rest_job
from tools.stack import LocalStack

S = "\ud800"  # json.dumps writes it as the escape "\\ud800", as JSON allows
ESCAPED = json.dumps({"a": S})  # arguments whose JSON text escapes one: '{"a": "\\ud800"}'
USER = {"role": "user", "content": "hi"}
FINAL = ("cancelled", "completed", "failed", "timed_out")


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    """A stack of this module's own: its tests count what preparation did since it started."""
    with ready_tiny_stack(tiny_llama, tmp_path_factory.mktemp("client-errors")) as stack:
        yield stack


def _preparation(stack: LocalStack) -> preparation_pb2_grpc.PreparationServiceStub:
    return preparation_pb2_grpc.PreparationServiceStub(grpc.insecure_channel(stack.target("preparation")))


def _registrations(stack: LocalStack) -> list[tuple[str, str, float]]:
    """Each registered engine as (id, process, when it registered, in seconds): a drop and a
    registration again changes the last (by a heartbeat at least)."""
    engines = _preparation(stack).ListEngines(preparation_pb2.ListEnginesRequest(), timeout=10).engines
    return [(e.engine_id, e.instance_id, e.registered_at.ToNanoseconds() / 1e9) for e in engines]


def _assert_no_reservation_left(stack: LocalStack) -> None:
    """Every slot preparation reserved is given back (bounded polling: the last Release may follow
    the answer by a moment)."""
    deadline = time.monotonic() + 20
    while True:
        engines = _preparation(stack).ListEngines(preparation_pb2.ListEnginesRequest(), timeout=10).engines
        capacity = _preparation(stack).GetCapacity(preparation_pb2.GetCapacityRequest(), timeout=10)
        held = sum(e.active_jobs for e in engines)
        if held == 0 and capacity.free_slots == int(TINY_SETTINGS["EXPERT_MAX_NUM_SEQS"]) * len(engines):
            return
        assert time.monotonic() < deadline, f"{held} reservations held, {capacity.free_slots} free"
        time.sleep(0.1)


def _assert_never_dropped(stack: LocalStack, before: list) -> None:
    after = _registrations(stack)
    # the same processes, registered when they were (preparation converts its monotonic clock to
    # the wall clock at each answer: the two readings may differ by microseconds)
    assert [(e, i) for e, i, _ in after] == [(e, i) for e, i, _ in before]
    assert all(abs(a[2] - b[2]) < 0.05 for a, b in zip(after, before, strict=True)), (before, after)
    assert "engine dropped" not in (stack.log_dir / "preparation.log").read_text()


def _chat(*messages, **fields) -> dict:
    return {"model": "llama", "messages": [*messages, USER], "max_tokens": 4, **fields}


def _assistant_call(arguments: str, name: str = "f") -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _tool(name: str = "f", description: str = "d") -> dict:
    function = {"name": name, "description": description, "parameters": {"type": "object"}}
    return {"type": "function", "function": function}


def _responses_call(arguments: str) -> dict:
    return {
        "model": "llama",
        "max_output_tokens": 4,
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    }


# (route, body, the field named): the surrogate as a JSON escape of the body (its field holds one),
# or escaped again inside the JSON text of the arguments (the engine would decode it to render)
BAD = [
    (
        "/v1/chat/completions",
        _chat(_assistant_call('{"a": "' + S + '"}')),
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("/v1/chat/completions", _chat(_assistant_call(ESCAPED)), "messages[0].tool_calls[0]"),
    (
        "/v1/chat/completions",
        _chat({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ESCAPED}}),
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        _chat({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": S}}),
        "messages[0].function_call.arguments",
    ),
    ("/v1/chat/completions", _chat(tools=[_tool(name="f" + S)]), "tools[0].function.name"),
    ("/v1/chat/completions", _chat(tools=[_tool(description=S)]), "tools[0].function.description"),
    ("/v1/responses", _responses_call('{"a": "' + S + '"}'), "input[0].arguments"),
    ("/v1/responses", _responses_call(ESCAPED), "input"),
    (
        "/v1/responses",
        {"model": "llama", "input": "hi", "tools": [{"type": "function", "name": "f", "description": S}]},
        "tools[0].description",
    ),
    (
        "/v1/jobs",
        {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": ESCAPED}]}, USER]},
        "messages[0].tool_calls[0].arguments",
    ),
]


def _post(stack: LocalStack, path: str, body: dict) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(stack.http_url() + path, content=json.dumps(body), headers=headers, timeout=120)


def test_bad_text_beside_six_ordinary_jobs_is_the_clients_error_and_the_engine_stays(stack):
    before = _registrations(stack)
    assert len(before) == 1
    ordinary = [("/v1/chat/completions", _chat(max_tokens=8, temperature=0.0), None)] * 6
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda case: _post(stack, case[0], case[1]), [*ordinary, *BAD]))
    for response in answers[:6]:
        assert response.status_code == 200, response.text[:300]
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    for (path, _, param), response in zip(BAD, answers[6:], strict=True):
        assert response.status_code == 400, (path, param, response.text[:300])
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"].startswith(param) and "surrogate" in error["message"], (param, error)
    _assert_never_dropped(stack, before)
    _assert_no_reservation_left(stack)


def _untokenizable_conversation() -> common_pb2.Conversation:
    """An assistant's call whose arguments decode to a lone surrogate, then the user's turn: what
    the engine renders, and no tokenizer can take."""
    call = common_pb2.ToolCall(id="c1", type="function", name="f", arguments=ESCAPED)
    return common_pb2.Conversation(
        messages=[
            common_pb2.ChatMessage(role="user", content="call f"),
            common_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            common_pb2.ChatMessage(role="tool", tool_call_id="c1", content="ok"),
        ]
    )


def test_the_engine_answers_a_request_it_cannot_tokenize_invalid_argument_naming_the_field(stack):
    before = _registrations(stack)
    request = engine_pb2.GenerateRequest(
        request_id="untokenizable",
        input=common_pb2.ModelInput(conversation=_untokenizable_conversation()),
        params=common_pb2.GenerationParams(max_tokens=4, temperature=0.0),
    )
    with grpc.insecure_channel(stack.target("engine")) as channel, pytest.raises(grpc.RpcError) as info:
        list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    fields = [field for field, _ in field_violations(info.value)]
    assert fields and fields[0].startswith("messages[1]") and "surrogate" in info.value.details()
    _assert_never_dropped(stack, before)


def test_a_job_the_engine_refuses_past_reception_fails_with_that_error_and_the_engine_stays(stack):
    """The job is queued straight into Redis, as reception would after admitting it, so that only
    the engine can refuse it: the dispatcher fails it with the engine's INVALID_ARGUMENT."""
    before = _registrations(stack)
    request = common_pb2.InferenceRequest(
        messages=_untokenizable_conversation().messages, max_tokens=4, timeout_ms=60_000
    )

    async def enqueue() -> None:
        redis = Redis.from_url(stack.redis_url)
        try:
            await JobStore(redis, ttl_s=600).create("untokenizable-job", request, 5, queue=stream(5))
        finally:
            await redis.aclose()

    asyncio.run(enqueue())
    with httpx.Client(base_url=stack.http_url(), timeout=30) as http:
        job = wait_rest_job(http, "untokenizable-job", lambda job: job["status"] in FINAL, timeout=60)
    assert job["status"] == "failed", job
    assert job["result"]["error_code"] == "INVALID_ARGUMENT", job
    _assert_never_dropped(stack, before)
    _assert_no_reservation_left(stack)
