"""The whole path on the default model: reception -> router -> preparation -> engine -> postproc, with
a real redis-server and the five services as processes, called through the SDK."""

from __future__ import annotations

import time

import grpc
import pytest

from expert_system import ExpertClient, InvalidRequest
from libs.engine import LLMEngine, SamplingParams
from libs.gen.expert.v1 import inference_pb2

pytestmark = pytest.mark.default_model

QUESTION = "What is the capital of France?"


def wait_final(client: ExpertClient, job_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get_job(job_id)
        if job.is_finished:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def wait_status(client: ExpertClient, job_id: str, status: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get_job(job_id).status != status:
        assert time.monotonic() < deadline, f"job {job_id} never reached {status}"
        time.sleep(0.02)


def wait_text(client: ExpertClient, job_id: str, timeout: float = 60.0) -> None:
    """Until the job has generated some text (or ended)."""
    deadline = time.monotonic() + timeout
    while not client.get_job(job_id).text:
        assert time.monotonic() < deadline, f"job {job_id} generated nothing"
        time.sleep(0.02)


def test_infer_answers_through_the_whole_pipeline(client):
    result = client.infer(prompt=QUESTION, temperature=0.0, max_tokens=40)
    assert "Paris" in result.text
    assert result.status == "completed" and result.finish_reason == "stop"
    assert result.job_id and result.experts_used == () and result.latency_ms > 0
    assert result.tokens_generated > 0 and result.validation.valid
    m = result.metrics
    assert m.router_latency_ms > 0 and m.inference_latency_ms > 0 and m.input_tokens > 0
    assert m.total_latency_ms >= m.inference_latency_ms
    assert "fallback" in result.reasoning_trace


def test_greedy_text_equals_the_engine_called_directly(client, default_model):
    prompts = [QUESTION, "Name three primary colours.", "Write one sentence about the sea."]
    engine = LLMEngine.from_pretrained(str(default_model), max_model_len=1024, num_blocks=64)
    for prompt in prompts:
        through_pipeline = client.infer(prompt=prompt, temperature=0.0, max_tokens=32, repetition_penalty=1.0)
        direct = engine.chat(
            [{"role": "user", "content": prompt}],
            SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.0),
        )[0]
        assert through_pipeline.text == direct.text


def test_raw_completion_and_templates_reach_the_engine_as_planned(client, default_model):
    engine = LLMEngine.from_pretrained(str(default_model), max_model_len=1024, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.0)
    raw = client.infer(
        prompt="The capital of Italy is", raw=True, temperature=0.0, max_tokens=16, repetition_penalty=1.0
    )
    assert raw.text == engine.generate(["The capital of Italy is"], params)[0].text
    templated = client.infer(
        prompt="Summarize:",
        body="Cats sleep a lot.",
        template="{prompt} {body}",
        temperature=0.0,
        max_tokens=16,
        repetition_penalty=1.0,
    )
    direct = engine.chat([{"role": "user", "content": "Summarize: Cats sleep a lot."}], params)[0]
    assert templated.text == direct.text


def test_infer_stream_yields_text_as_it_is_generated(client):
    stream = client.infer_stream(prompt="Tell me a story", temperature=0.0, max_tokens=48)
    chunks = [chunk.text for chunk in stream]
    assert len(chunks) > 3
    assert "".join(chunks) == stream.result.text and stream.result.status == "completed"
    assert stream.job_id == stream.result.job_id


def test_submitted_jobs_run_in_the_background(client):
    submission = client.submit(prompt=QUESTION, temperature=0.0, max_tokens=24)
    assert submission.status == "queued" and submission.estimated_wait_ms >= 0
    job = wait_final(client, submission.job_id)
    assert job.status == "completed" and "Paris" in job.result.text and job.text == job.result.text
    assert job.finished_at >= job.submitted_at


def test_cancel_stops_a_running_job_and_frees_its_kv(client, stack):
    job = client.submit(prompt="Write a very long story about a dragon.", temperature=0.0, max_tokens=600)
    wait_status(client, job.job_id, "running")
    wait_text(client, job.job_id)  # cancelled mid-generation, not before its first token
    client.cancel(job.job_id)
    final = wait_final(client, job.job_id)
    assert final.status == "cancelled" and final.result.finish_reason == "abort"
    assert 0 < final.result.tokens_generated < 600
    assert_engine_idle(stack)


def test_a_queued_job_is_cancelled_at_once(client):
    blocker = client.submit(prompt="Write a long poem.", temperature=0.0, max_tokens=200)
    queued = client.submit(prompt=QUESTION)
    assert client.cancel(queued.job_id).status == "cancelled"
    client.cancel(blocker.job_id)
    wait_final(client, blocker.job_id)
    assert wait_final(client, queued.job_id).result.tokens_generated == 0


def test_timeout_ends_the_job_with_its_partial_output(client, stack):
    result = client.infer(
        prompt="Write a very long story about a knight.", temperature=0.0, max_tokens=900, timeout_ms=5000
    )
    # 5 s: long enough for the first tokens on a loaded machine, short of 900 tokens (the story
    # runs on past them) on any CPU.
    assert result.status == "timed_out" and result.timed_out and result.finish_reason == "timeout"
    assert result.text and 0 < result.tokens_generated < 900
    assert_engine_idle(stack)


def test_a_backlog_is_served_by_priority(client):
    blocker = client.submit(prompt="Write a long poem about winter.", temperature=0.0, max_tokens=600)
    wait_status(client, blocker.job_id, "running")  # the blocker holds the engine's only slot
    priorities = [1, 8, 3, 9, 5, 0, 7]
    jobs = [
        (p, client.submit(prompt=f"Say the number {p}.", temperature=0.0, max_tokens=8, priority=p))
        for p in priorities
    ]
    client.cancel(blocker.job_id)  # the backlog is all queued: the slot frees now, whatever the load
    finished = [(wait_final(client, job.job_id).finished_at, p) for p, job in jobs]
    wait_final(client, blocker.job_id)
    assert [p for _, p in sorted(finished)] == sorted(priorities, reverse=True)


def test_a_job_that_times_out_in_the_queue_ends_timed_out(client):
    blocker = client.submit(prompt="Write a long poem about autumn.", temperature=0.0, max_tokens=200)
    wait_status(client, blocker.job_id, "running")  # the engine's only slot is taken
    result = client.infer(prompt=QUESTION, timeout_ms=400)
    assert result.status == "timed_out" and result.timed_out and result.finish_reason == "timeout"
    assert result.tokens_generated == 0 and "queue" in result.error
    client.cancel(blocker.job_id)
    wait_final(client, blocker.job_id)


def test_jobs_cancelled_at_any_stage_never_leak_an_engine_slot(client, stack):
    # Cancels land while jobs are queued, planned, being placed and running; whichever it is,
    # preparation must get the job's slot back (the stack has one, so a leak stops everything).
    for delay in (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12):
        job = client.submit(prompt=QUESTION, temperature=0.0, max_tokens=64)
        time.sleep(delay)
        client.cancel(job.job_id)
        wait_final(client, job.job_id)
    assert client.infer(prompt=QUESTION, temperature=0.0, max_tokens=8, timeout_ms=30_000).status == (
        "completed"
    )


def _generate(stack, **fields) -> list:
    """The engine service's Generate, called directly (no job): every streamed message."""
    from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    request = engine_pb2.GenerateRequest(
        input=common_pb2.ModelInput(
            conversation=common_pb2.Conversation(
                messages=[common_pb2.ChatMessage(role="user", content="Write a long story about a dragon.")]
            )
        ),
        **fields,
    )
    with grpc.insecure_channel(stack.target("engine")) as channel:
        return list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=60))


def test_the_engine_sends_text_every_stream_interval_tokens(stack):
    from libs.gen.expert.v1 import common_pb2

    params = common_pb2.GenerationParams(temperature=0.0, max_tokens=10)
    every_token = _generate(stack, params=params)
    by_four = _generate(stack, params=params, stream_interval=4)
    assert [len(m.token_ids) for m in every_token] == [1] * 10
    assert [len(m.token_ids) for m in by_four] == [4, 4, 2]
    assert "".join(m.text for m in by_four) == "".join(m.text for m in every_token)
    assert by_four[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert by_four[-1].usage.completion_tokens == 10


def test_the_engine_ends_a_request_at_its_deadline_with_the_text_so_far(stack):
    from google.protobuf.timestamp_pb2 import Timestamp

    from libs.gen.expert.v1 import common_pb2

    deadline = Timestamp()
    deadline.FromNanoseconds(int((time.time() + 1.0) * 1e9))
    messages = _generate(
        stack,
        params=common_pb2.GenerationParams(temperature=0.0, max_tokens=600),
        stream_interval=1000,  # nothing is sent before the end: the last message must carry it all
        deadline=deadline,
    )
    assert len(messages) == 1
    final = messages[0]
    assert final.finish_reason == common_pb2.FINISH_REASON_TIMEOUT
    assert final.text and 0 < len(final.token_ids) == final.usage.completion_tokens < 600
    assert_engine_idle(stack)


def test_an_aborted_request_ends_its_stream_with_the_text_not_yet_sent(stack):
    import threading

    from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(stack.target("engine")) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        assert not stub.Abort(engine_pb2.AbortRequest(request_id="no-such-request")).found
        with pytest.raises(grpc.RpcError) as empty:
            stub.Abort(engine_pb2.AbortRequest())
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in empty.value.details()

        abort = engine_pb2.AbortRequest(request_id="to-abort")
        aborted = threading.Timer(1.0, stub.Abort, [abort])
        aborted.start()
        messages = _generate(
            stack,
            request_id="to-abort",
            params=common_pb2.GenerationParams(temperature=0.0, max_tokens=600),
            stream_interval=1000,
        )
        aborted.join()
    assert len(messages) == 1 and messages[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert messages[0].text and 0 < len(messages[0].token_ids) < 600
    assert_engine_idle(stack)


def assert_engine_idle(stack, timeout: float = 10.0) -> None:
    from libs.gen.expert.v1 import engine_pb2, engine_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(stack.target("engine")) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        while True:
            load = stub.GetStats(engine_pb2.GetStatsRequest()).load
            idle = (
                load.kv_blocks_used == 0
                and load.kv_blocks_free + load.kv_blocks_cached == load.kv_blocks_total
            )
            if load.running == load.waiting == 0 and idle:
                return
            assert time.monotonic() < deadline, f"the engine still holds work: {load}"
            time.sleep(0.1)


# -- validation ---------------------------------------------------------------------------------------

SEED_RULES = [
    ({"prompt": ""}, "request.prompt", "Prompt cannot be empty"),
    ({"prompt": "   "}, "request.prompt", "Prompt cannot be empty"),
    ({"prompt": "x" * 500_001}, "request.prompt", "Prompt too long"),
    ({"temperature": -0.1}, "request.temperature", "Temperature must be in [0.0, 2.0]"),
    ({"temperature": 2.5}, "request.temperature", "Temperature must be in [0.0, 2.0]"),
    ({"max_tokens": 0}, "request.max_tokens", "max_tokens must be in [1, 200000]"),
    ({"max_tokens": 200_001}, "request.max_tokens", "max_tokens must be in [1, 200000]"),
    ({"max_experts": 0}, "request.max_experts", "max_experts must be in [1, 10]"),
    ({"max_experts": 11}, "request.max_experts", "max_experts must be in [1, 10]"),
]
ADDED_BOUNDS = [
    ({"top_p": 0.0}, "request.top_p"),
    ({"top_p": 1.5}, "request.top_p"),
    ({"top_k": -1}, "request.top_k"),
    ({"min_p": -0.5}, "request.min_p"),
    ({"min_p": 1.5}, "request.min_p"),
    ({"repetition_penalty": 0.9}, "request.repetition_penalty"),
    ({"repetition_penalty": 2.5}, "request.repetition_penalty"),
    ({"presence_penalty": -2.5}, "request.presence_penalty"),
    ({"presence_penalty": 2.5}, "request.presence_penalty"),
    ({"frequency_penalty": -3.0}, "request.frequency_penalty"),
    ({"frequency_penalty": 2.01}, "request.frequency_penalty"),
    ({"priority": -1}, "request.priority"),
    ({"priority": 10}, "request.priority"),
    ({"timeout_ms": 0}, "request.timeout_ms"),
    ({"timeout_ms": -5}, "request.timeout_ms"),
    ({"stop": [f"s{i}" for i in range(17)]}, "request.stop"),
    ({"stop": ["ok", ""]}, "request.stop[1]"),
    ({"context_size": 4096}, "request.context_size"),  # the model's window is 1024
    ({"max_tokens": 1024}, "request.max_tokens"),  # leaves no room for the prompt
    ({"context_size": 0}, "request.context_size"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "request.messages[0].role"),
    ({"json_schema": "{not json"}, "request.json_schema"),
    ({"force_experts": ["a"], "exclude_experts": ["a"]}, "request.exclude_experts"),
    ({"prompt": "nul \x00 byte"}, "request.prompt"),
    ({"body": "nul \x00 byte"}, "request.body"),
]


@pytest.mark.parametrize(("fields", "field", "message"), SEED_RULES)
def test_seed_000_validation_rules_are_invalid_argument_naming_the_field(client, fields, field, message):
    with pytest.raises(InvalidRequest) as info:
        client.infer(**{"prompt": QUESTION, **fields})
    assert (field, message) in [(f, d.split(" (")[0]) for f, d in info.value.field_violations]


@pytest.mark.parametrize(("fields", "field"), ADDED_BOUNDS)
def test_every_other_field_is_bounded(client, fields, field):
    with pytest.raises(InvalidRequest) as info:
        client.submit(**{"prompt": QUESTION, **fields})
    assert field in [f for f, _ in info.value.field_violations]


def test_several_problems_are_reported_together(client):
    with pytest.raises(InvalidRequest) as info:
        client.submit(prompt="", temperature=9, top_p=0)
    assert {f for f, _ in info.value.field_violations} == {
        "request.prompt",
        "request.temperature",
        "request.top_p",
    }


def test_invalid_utf8_is_a_clear_error(stack):
    # A protobuf library will not encode invalid UTF-8, so the request is written by hand:
    # InferRequest{request (1): InferenceRequest{prompt (1): b"\xff\xfe"}}
    prompt = b"\x0a\x02\xff\xfe"
    payload = b"\x0a" + bytes([len(prompt)]) + prompt
    with grpc.insecure_channel(stack.target("reception")) as channel:
        infer = channel.unary_unary(
            "/expert.v1.InferenceService/Infer",
            request_serializer=lambda b: b,
            response_deserializer=inference_pb2.InferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            infer(payload, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in info.value.details()


def test_unicode_is_normalized_to_nfc_and_trimmed(client):
    composed = client.infer(prompt="  Caf\u00e9?  ", raw=True, temperature=0.0, max_tokens=6)
    decomposed = client.infer(prompt="Cafe\u0301?", raw=True, temperature=0.0, max_tokens=6)
    assert composed.text == decomposed.text


def test_unknown_jobs_are_not_found(client):
    from expert_system import NotFound

    with pytest.raises(NotFound):
        client.get_job("no-such-job")
    with pytest.raises(NotFound):
        client.cancel("no-such-job")


def test_a_forced_unknown_expert_fails_the_call_naming_the_field(client):
    with pytest.raises(InvalidRequest) as info:
        client.infer(prompt=QUESTION, force_experts=["json-parser"])
    assert info.value.field_violations[0][0] == "request.force_experts[0]"
