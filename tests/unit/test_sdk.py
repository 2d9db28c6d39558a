"""The `expert_system` SDK: keywords -> InferenceRequest, protobufs -> dataclasses, gRPC errors ->
exceptions, and the streamed events -> chunks, over a real gRPC connection.

The server is a test double (tests/helpers/fake_reception.py) with predictable behaviour, not the
reception: these tests are about the client's translation layer, and the real reception is
tested on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime

import grpc
import pytest

from expert_system import (
    AppliedExpert,
    AsyncExpertClient,
    DeadlineExceeded,
    ExpertClient,
    ExpertSystemError,
    InferenceMetrics,
    InferenceResult,
    InvalidRequest,
    Job,
    JobSubmission,
    NotFound,
    RequestFields,
    StreamChunk,
    Unavailable,
    ValidationResult,
)
from libs.gen.expert.v1 import common_pb2
from tests.helpers.fake_reception import LATENCY_MS, SUBMITTED_AT, TRACE, serve_fakes, unused_port

ALL_FIELDS = {
    "template": "Q: {prompt}\n{body}",
    "body": '{"name": "Alice"}',
    "temperature": 0.25,
    "max_tokens": 64,
    "top_p": 0.75,
    "top_k": 40,
    "min_p": 0.125,
    "repetition_penalty": 1.5,
    "force_experts": ["json-parser", "summarizer"],
    "exclude_experts": ["poet"],
    "max_experts": 3,
    "context_size": 4096,
    "user_id": "alice",
    "priority": 7,
    "timeout_ms": 30_000,
    "stop": ["\n\n", "END"],
    "seed": 2**63 + 5,
    "presence_penalty": -0.5,
    "frequency_penalty": 0.5,
    "messages": [{"role": "system", "content": "Be brief."}],
    "raw": True,
    "json_schema": '{"type": "object"}',
    "model": "SmolLM2-135M-Instruct",
    "n": 2,
    "logprobs": 3,
    "prompt_token_ids": [5, 6],
    "ignore_eos": True,
    "skip_special_tokens": False,
    "speculative": True,
    "best_of": 4,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "early_stopping": "never",
    # in OpenAI's shape (reception refuses it beside json_schema; the SDK sends what it is given)
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": {"type": "object"}},
    },
    # in OpenAI's shape, the parameters a dict (sent as JSON text)
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
}
# What ALL_FIELDS' response_format becomes on the wire.
PERSON_FORMAT = common_pb2.ResponseFormat(
    json_schema=common_pb2.JsonSchemaFormat(name="person", schema='{"type": "object"}')
)


@pytest.fixture(scope="module")
def fakes():
    with serve_fakes() as server:
        yield server


@pytest.fixture
def client(fakes):
    with ExpertClient(fakes.target) as client:
        yield client


def test_the_keywords_are_the_request_fields_besides_prompt_and_the_regex_and_grammar_shorthands():
    proto_fields = set(common_pb2.InferenceRequest.DESCRIPTOR.fields_by_name) - {"prompt"}
    assert proto_fields == set(ALL_FIELDS)
    assert set(RequestFields.__annotations__) == proto_fields | {"regex", "grammar"}


def test_every_keyword_reaches_its_proto_field(client, fakes):
    client.infer(prompt="Parse this JSON", **ALL_FIELDS)
    expected = common_pb2.InferenceRequest(
        prompt="Parse this JSON",
        **{
            k: v
            for k, v in ALL_FIELDS.items()
            if k not in ("messages", "response_format", "tools", "tool_choice")
        },
        messages=[common_pb2.ChatMessage(role="system", content="Be brief.")],
        response_format=PERSON_FORMAT,
        tools=[common_pb2.Tool(name="lookup", parameters='{"type": "object"}')],
        tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
    )
    assert fakes.reception.last_request == expected


def test_keywords_left_out_stay_unset(client, fakes):
    client.infer(prompt="hello")
    request = fakes.reception.last_request
    optional = [f.name for f in request.DESCRIPTOR.fields if f.has_presence]
    assert "temperature" in optional and "seed" in optional
    assert [name for name in optional if request.HasField(name)] == []
    assert request == common_pb2.InferenceRequest(prompt="hello")


def test_zero_is_sent_and_none_is_left_out(client, fakes):
    client.infer(prompt="hello", temperature=0.0, top_k=0, max_tokens=None)
    request = fakes.reception.last_request
    assert request.HasField("temperature") and request.temperature == 0.0
    assert request.HasField("top_k") and not request.HasField("max_tokens")


def test_an_unknown_keyword_is_a_type_error_naming_it(client, fakes):
    sent = len(fakes.reception.requests)
    with pytest.raises(TypeError, match=r"infer\(\) got an unexpected keyword argument 'temprature'"):
        client.infer(prompt="hello", temprature=0.5)
    with pytest.raises(TypeError, match="'bogus'"):
        client.submit(prompt="hello", bogus=1)
    assert len(fakes.reception.requests) == sent


def test_a_value_of_the_wrong_type_names_its_field(client):
    with pytest.raises(TypeError, match=r"^temperature: "):
        client.infer(prompt="hello", temperature="hot")
    with pytest.raises(ValueError, match=r"^seed: "):
        client.infer(prompt="hello", seed=-1)
    with pytest.raises(TypeError, match=r"^messages\[1\]: "):
        client.infer(messages=[{"role": "user", "content": "hi"}, {"role": "user"}])


def test_a_lone_stop_string_is_one_stop_and_a_schema_dict_is_serialised(client, fakes):
    client.infer(prompt="hello", stop="END", json_schema={"type": "object"})
    request = fakes.reception.last_request
    assert list(request.stop) == ["END"]
    assert json.loads(request.json_schema) == {"type": "object"}


@pytest.mark.parametrize(
    ("keywords", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": {}}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": '{"type": "array"}',
                        "strict": True,
                        "description": "d",
                    },
                }
            },
            {"json_schema": {"name": "n", "schema": '{"type": "array"}', "strict": True, "description": "d"}},
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            {"json_schema": {"schema": "{}"}},
        ),
        ({"response_format": {"type": "regex", "regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"response_format": {"type": "grammar", "grammar": 'start: "a"'}}, {"grammar": 'start: "a"'}),
        ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
        ({"regex": ""}, {"regex": ""}),  # sent: reception says why it is refused
    ],
)
def test_each_kind_of_format_reaches_response_format(client, fakes, keywords, expected):
    client.infer(prompt="hello", **keywords)
    request = fakes.reception.last_request
    assert request.response_format == common_pb2.ResponseFormat(**expected)
    assert not request.HasField("json_schema")


def test_a_text_response_format_sets_no_format(client, fakes):
    client.infer(prompt="hello", response_format={"type": "text"})
    assert not fakes.reception.last_request.HasField("response_format")


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"response_format": "json"}, TypeError, r"^response_format: expected a dict with 'type'"),
        ({"response_format": {"type": "xml"}}, ValueError, r"^response_format\.type: must be one of text, "),
        ({"response_format": {}}, ValueError, r"^response_format\.type: "),
        (
            {"response_format": {"type": "json_object", "schema": {}}},
            ValueError,
            r"^response_format\.schema: ",
        ),
        ({"response_format": {"type": "regex"}}, ValueError, r"^response_format\.regex: required"),
        ({"response_format": {"type": "regex", "regex": 5}}, TypeError, r"^response_format\.regex: "),
        (
            {"response_format": {"type": "json_schema"}},
            TypeError,
            r"^response_format\.json_schema: expected a dict",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            ValueError,
            r"^response_format\.json_schema\.schema: required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            TypeError,
            r"^response_format\.json_schema\.schema: expected a dict or JSON text",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
            ValueError,
            r"^response_format\.json_schema\.extra: not an argument",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 7}}},
            TypeError,
            r"^response_format\.json_schema\.name: ",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}},
            TypeError,
            r"^response_format\.json_schema\.strict: expected True or False",
        ),
        ({"regex": ["a"]}, TypeError, r"^regex: "),
        (
            {"regex": "a", "grammar": 'start: "a"'},
            ValueError,
            r"^grammar: give one of response_format, regex and grammar",
        ),
        (
            {"response_format": {"type": "json_object"}, "regex": "a"},
            ValueError,
            r"^regex: give one of response_format, regex and grammar, not response_format too",
        ),
    ],
)
def test_a_bad_format_is_refused_before_sending_naming_its_part(client, fakes, keywords, error, message):
    sent = len(fakes.reception.requests)
    with pytest.raises(error, match=message):
        client.infer(prompt="hello", **keywords)
    assert len(fakes.reception.requests) == sent


def test_infer_returns_frozen_dataclasses_with_string_enums(client):
    result = client.infer(prompt="Parse this JSON and extract fields", force_experts=["json-parser"])
    assert isinstance(result, InferenceResult)
    assert result.text == "Parse this JSON and extract fields"
    assert (result.status, result.finish_reason, result.timed_out) == ("completed", "stop", False)
    assert result.job_id.startswith("job-") and result.tokens_generated == 6
    assert result.experts_used == ("json-parser",) and result.latency_ms == LATENCY_MS
    assert result.experts == (AppliedExpert("json-parser", "1.0.0", "lora", 0.5),)
    assert result.validation == ValidationResult(valid=True, validator="generic", error="")
    assert result.reasoning_trace == TRACE
    assert isinstance(result.metrics, InferenceMetrics) and result.metrics.job_id == result.job_id
    assert result.metrics.submitted_at == SUBMITTED_AT and result.metrics.submitted_at.tzinfo == UTC
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.text = "changed"


def test_a_job_a_stage_refused_carries_its_error_code_and_fields(client):
    result = client.get_job(client.submit(prompt="refuse this one").job_id).result
    assert (result.status, result.finish_reason, result.error_code) == ("failed", "error", "INVALID_ARGUMENT")
    assert result.error_fields == (("request.max_tokens", "exceeds the context window 2048"),)


def test_a_timed_out_job_returns_its_partial_output(client):
    result = client.infer(prompt="a long story", timeout_ms=50)
    assert (result.status, result.finish_reason, result.timed_out, result.text) == (
        "timed_out",
        "timeout",
        True,
        "a",
    )


def test_infer_stream_yields_text_deltas_then_keeps_the_result(client):
    stream = client.infer_stream(prompt="Write a story about a lighthouse")
    chunks = list(stream)
    assert all(isinstance(c, StreamChunk) and not c.restarted for c in chunks) and len(chunks) == 6
    assert "".join(c.text for c in chunks) == "Write a story about a lighthouse"
    assert stream.job_id and stream.job_id == stream.result.job_id
    assert stream.result.text == "Write a story about a lighthouse" and stream.status == "completed"
    assert stream.submission.submitted_at == SUBMITTED_AT


def test_a_restart_yields_an_empty_restarted_chunk_and_the_text_starts_over(client):
    stream = client.infer_stream(prompt="please restart this job")
    chunks = list(stream)
    marks = [i for i, c in enumerate(chunks) if c.restarted]
    assert len(marks) == 1 and chunks[marks[0]] == StreamChunk(text="", restarted=True, attempt=2)
    assert "".join(c.text for c in chunks[: marks[0]]) == "please restart "
    assert "".join(c.text for c in chunks[marks[0] + 1 :]) == "please restart this job"
    assert stream.restarts == 1 and stream.result.text == "please restart this job"


def test_breaking_out_of_a_stream_cancels_the_call(client, fakes):
    fakes.reception.stream_cancelled.clear()
    stream = client.infer_stream(prompt="forever and ever")
    for i, chunk in enumerate(stream):
        assert chunk.text == "tick "
        if i == 2:
            break
    assert fakes.reception.stream_cancelled.wait(5)
    assert stream.result is None and stream.job_id


def test_a_stream_is_iterated_once(client):
    stream = client.infer_stream(prompt="once")
    list(stream)
    with pytest.raises(RuntimeError, match="once"):
        list(stream)


def test_invalid_argument_becomes_invalid_request_with_field_violations(client):
    with pytest.raises(InvalidRequest) as caught:
        client.infer(prompt="hello", temperature=2.5, priority=12)
    error = caught.value
    assert isinstance(error, ExpertSystemError) and error.code == "INVALID_ARGUMENT"
    assert error.message == "the request has invalid fields"
    assert error.field_violations == [
        ("request.temperature", "must be in [0, 2], got 2.5"),
        ("request.priority", "must be in [0, 9], got 12"),
    ]


def test_a_refused_stream_raises_when_iterated(client):
    stream = client.infer_stream(prompt="hello", temperature=3.0)
    with pytest.raises(InvalidRequest) as caught:
        list(stream)
    assert caught.value.field_violations == [("request.temperature", "must be in [0, 2], got 3")]


def test_submit_get_job_and_cancel(client):
    submission = client.submit(prompt="slow job here", priority=8)
    assert isinstance(submission, JobSubmission)
    assert (submission.status, submission.estimated_wait_ms) == ("queued", 1500)
    assert submission.submitted_at == SUBMITTED_AT
    job = client.get_job(submission.job_id)
    assert isinstance(job, Job) and (job.status, job.text, job.result) == ("running", "slow", None)
    assert (job.priority, job.attempts, job.finished_at, job.is_finished) == (8, 1, None, False)
    cancelled = client.cancel(submission.job_id)
    assert cancelled.status == "cancelled" and cancelled.is_finished
    assert isinstance(cancelled.finished_at, datetime)


def test_a_finished_job_carries_its_result(client):
    job = client.get_job(client.submit(prompt="quick job").job_id)
    assert job.status == "completed" and job.result.text == "quick job" and job.is_finished


def test_unknown_jobs_are_not_found(client):
    with pytest.raises(NotFound) as caught:
        client.get_job("job-missing")
    assert caught.value.code == "NOT_FOUND" and "job-missing" in caught.value.message
    assert caught.value.field_violations == []
    with pytest.raises(NotFound):
        client.cancel("job-missing")


def test_an_unreachable_reception_is_unavailable():
    with ExpertClient(f"127.0.0.1:{unused_port()}") as client, pytest.raises(Unavailable) as caught:
        client.infer(prompt="hello")
    assert caught.value.code == "UNAVAILABLE"


def test_the_timeout_is_the_call_deadline(client):
    with pytest.raises(DeadlineExceeded):
        client.infer(prompt="sleep a while", timeout=0.2)


def test_messages_of_64_mib_pass_both_ways(client):
    prompt = "x" * (8 * 1024 * 1024)  # twice gRPC's default limit of 4 MiB
    assert client.infer(prompt=prompt).text == prompt


def test_the_target_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("EXPERT_RECEPTION_TARGET", "reception.internal:6000")
    assert ExpertClient().target == "reception.internal:6000"
    monkeypatch.delenv("EXPERT_RECEPTION_TARGET")
    assert ExpertClient().target == "127.0.0.1:50051"


def test_the_async_client_infers_and_streams(fakes):
    async def run():
        async with AsyncExpertClient(fakes.target) as client:
            result = await client.infer(prompt="async hello", temperature=0.5)
            stream = client.infer_stream(prompt="async restart of a stream")
            chunks = [chunk async for chunk in stream]
            return result, stream, chunks

    result, stream, chunks = asyncio.run(run())
    assert result.text == "async hello" and result.finish_reason == "stop"
    assert fakes.reception.requests[-2].temperature == 0.5
    assert [c.attempt for c in chunks if c.restarted] == [2]
    assert stream.result.text == "async restart of a stream" and stream.job_id == stream.result.job_id


def test_the_async_client_raises_the_same_errors(fakes):
    async def run():
        async with AsyncExpertClient(fakes.target) as client:
            with pytest.raises(InvalidRequest) as refused:
                await client.infer(prompt="hello", temperature=9.0)
            with pytest.raises(InvalidRequest):
                _ = [chunk async for chunk in client.infer_stream(prompt="hello", temperature=9.0)]
            with pytest.raises(NotFound):
                await client.get_job("job-missing")
            submission = await client.submit(prompt="slow async job")
            job = await client.get_job(submission.job_id)
            cancelled = await client.cancel(submission.job_id)
            return refused.value, job, cancelled

    refused, job, cancelled = asyncio.run(run())
    assert refused.field_violations == [("request.temperature", "must be in [0, 2], got 9")]
    assert job.status == "running" and cancelled.status == "cancelled"


def test_the_async_stream_cancels_the_call_when_left(fakes):
    fakes.reception.stream_cancelled.clear()

    async def run():
        async with AsyncExpertClient(fakes.target) as client:
            async with client.infer_stream(prompt="forever async") as stream:
                async for chunk in stream:
                    assert chunk.text == "tick "
                    break
            return stream

    stream = asyncio.run(run())
    assert fakes.reception.stream_cancelled.wait(5) and stream.result is None


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest"),
        (grpc.StatusCode.NOT_FOUND, "NotFound"),
        (grpc.StatusCode.FAILED_PRECONDITION, "FailedPrecondition"),
        (grpc.StatusCode.UNAVAILABLE, "Unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "DeadlineExceeded"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "ResourceExhausted"),
        (grpc.StatusCode.INTERNAL, "ExpertSystemError"),
    ],
)
def test_each_status_a_caller_reacts_to_has_its_exception(code, cls):
    import expert_system
    from expert_system.errors import error_from_status

    error = error_from_status(code, "why", None)
    assert type(error) is getattr(expert_system, cls)
    assert (error.code, error.message) == (code.name, "why")
