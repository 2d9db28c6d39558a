"""Hostile input against a real stack: random requests (hypothesis) at reception's public gRPC API.

Submit gets requests shaped around every input limit: each answer is an accepted job or
INVALID_ARGUMENT naming a field. Then every method of every public service (protos/generate.py's
PUBLIC) gets random messages built from its descriptor (tests/helpers/fuzzing.py): never INTERNAL,
UNKNOWN, a metadata overflow or a hang. Every service still reports SERVING afterwards. Accepted
jobs are cancelled at once, so the engine spends little time on them. The HTTP routes have their
own fuzzer, driven by reception's OpenAPI document (test_http_fuzz.py).
"""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import descriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import libs.gen.expert.v1 as gen
from libs import errors
from libs.auth.metadata import credentials_metadata
from libs.errors import field_violations
from libs.gen.expert.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from protos.generate import PUBLIC
from tests.e2e.conftest import stack_env
from tests.helpers.fuzzing import SURROGATE_STAND_IN, Budget, fuzz_seed, messages, with_surrogates
from tools.stack import SERVICES, LocalStack, health_status

EXAMPLES = 500
ROLES = ("system", "user", "assistant", "tool")

# Sizes around every limit, and far beyond (reception's limits are in docs/design.md).
SIZES = (0, 1, 255, 257, 1_000, 1_001, 16_385, 50_001, 250_001, 500_001, 1_000_000)


def _long_text() -> st.SearchStrategy[str]:
    return st.builds(
        lambda piece, size: (piece * size)[:size], st.text(min_size=1, max_size=3), st.sampled_from(SIZES)
    )


def _text(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=max_size), _long_text())


def _schema_text() -> st.SearchStrategy[str]:
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=12,
    )
    keywords = st.sampled_from(["type", "properties", "items", "$ref", "required", "enum", "anyOf", "$defs"])
    schemas = st.dictionaries(keywords, json_values, max_size=4)
    nested = st.builds(
        lambda depth, key: f'{{"{key}": ' * depth + "{}" + "}" * depth,
        st.integers(0, 20_000),
        st.sampled_from(["items", "not", "additionalProperties"]),
    )
    brackets = st.builds(lambda depth: "[" * depth + "]" * depth, st.integers(0, 10_000))
    refs = st.sampled_from(['{"$ref": "#"}', '{"$ref": "#/$defs/x"}', '{"$ref": "https://example.com/s"}'])
    return st.one_of(st.builds(json.dumps, schemas), nested, brackets, refs, st.text(max_size=30))


def _response_format() -> st.SearchStrategy[common_pb2.ResponseFormat]:
    regexes = st.one_of(st.text(max_size=20), st.sampled_from(["[a-z", "(?=a)b", r"(\w)\1", "(a|b)*c", ".*"]))
    grammars = st.one_of(
        st.text(max_size=30),
        st.sampled_from(['start: "a"', "start: x", "start: start", 'start: %json {"type": "object"}']),
    )
    return st.one_of(
        st.just(common_pb2.ResponseFormat()),
        st.just(common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())),
        st.builds(
            lambda schema, name: common_pb2.ResponseFormat(
                json_schema=common_pb2.JsonSchemaFormat(name=name, schema=schema)
            ),
            _schema_text(),
            _text(12),
        ),
        st.builds(lambda regex: common_pb2.ResponseFormat(regex=regex), st.one_of(regexes, _long_text())),
        st.builds(
            lambda grammar: common_pb2.ResponseFormat(grammar=grammar), st.one_of(grammars, _long_text())
        ),
    )


def _floats() -> st.SearchStrategy[float]:
    return st.floats(allow_nan=True, allow_infinity=True, width=32)


def _messages() -> st.SearchStrategy[list[common_pb2.ChatMessage]]:
    message = st.builds(
        common_pb2.ChatMessage, role=st.one_of(st.sampled_from(ROLES), st.text(max_size=10)), content=_text()
    )
    turn = common_pb2.ChatMessage(role="user", content="hi")
    many = st.builds(lambda n: [turn] * n, st.sampled_from([999, 1_000, 1_001, 5_000]))
    return st.one_of(st.lists(message, max_size=4), many)


def _names() -> st.SearchStrategy[list[str]]:
    many = st.builds(lambda n: [f"expert-{i}" for i in range(n)], st.sampled_from([10, 11, 100, 101, 1_000]))
    return st.one_of(st.lists(_text(12), max_size=3), many)


REQUESTS = st.fixed_dictionaries(
    {"prompt": _text()},
    optional={
        "template": _text(),
        "body": _text(),
        "temperature": _floats(),
        "max_tokens": st.integers(-(2**31), 2**31 - 1),
        "top_p": _floats(),
        "top_k": st.integers(-(2**31), 2**31 - 1),
        "min_p": _floats(),
        "repetition_penalty": _floats(),
        "force_experts": _names(),
        "exclude_experts": _names(),
        "max_experts": st.integers(-(2**31), 2**31 - 1),
        "context_size": st.integers(-(2**31), 2**31 - 1),
        "user_id": _text(),
        "priority": st.integers(-(2**31), 2**31 - 1),
        "timeout_ms": st.integers(-(2**63), 2**63 - 1),
        "stop": st.one_of(st.lists(_text(8), max_size=4), st.lists(_long_text(), min_size=1, max_size=17)),
        "seed": st.integers(0, 2**64 - 1),
        "presence_penalty": _floats(),
        "frequency_penalty": _floats(),
        "messages": _messages(),
        "raw": st.booleans(),
        "json_schema": _schema_text(),
        "response_format": _response_format(),
    },
)


def _check_refusal(error: grpc.RpcError) -> None:
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, f"{error.code().name}: {error.details()[:300]}"
    violations = field_violations(error)
    assert violations, f"INVALID_ARGUMENT without a field: {error.details()[:300]}"
    assert all(field.startswith(("request", "job_id")) for field, _ in violations), violations


@pytest.fixture(scope="module")
def fuzz_stack(tiny_llama, tmp_path_factory):
    env = stack_env(
        tiny_llama,
        EXPERT_MAX_MODEL_LEN="1024",
        EXPERT_KV_NUM_BLOCKS="160",
        EXPERT_MAX_NUM_SEQS="4",
        EXPERT_INTERNAL_TOKEN=TOKEN,
    )
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("fuzz"), env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def stub(fuzz_stack):
    with grpc.insecure_channel(fuzz_stack.target("reception")) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel), channel


def test_random_requests_are_accepted_or_refused_by_field(fuzz_stack, stub):
    service, _ = stub
    seen = {"accepted": 0, "refused": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,  # nothing written into the checkout
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(REQUESTS)
    def submit(fields):
        request = common_pb2.InferenceRequest(**fields)
        try:
            submission = service.Submit(inference_pb2.SubmitRequest(request=request), timeout=30)
        except grpc.RpcError as error:
            _check_refusal(error)
            seen["refused"] += 1
            return
        seen["accepted"] += 1
        service.CancelJob(inference_pb2.CancelJobRequest(job_id=submission.submission.job_id), timeout=30)

    submit()
    print(f"fuzz: {seen}")
    assert sum(seen.values()) >= EXAMPLES, seen
    assert seen["accepted"] and seen["refused"], seen  # both sides of the rules were exercised
    _all_serving(fuzz_stack)


@settings(max_examples=100, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_undecodable_bytes_are_refused_by_field(fuzz_stack, stub, data):
    """Bytes that are not a request message (bad UTF-8, wrong wire types) on every method."""
    _, channel = stub
    for method in ("Submit", "GetJob", "CancelJob"):
        call = channel.unary_unary(f"/expert.v1.InferenceService/{method}")  # bytes in, bytes out
        try:
            call(data, timeout=30)
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.NOT_FOUND:  # bytes that parse as an unknown job id
                continue
            _check_refusal(error)


def test_every_service_is_serving_after_the_fuzz(fuzz_stack):
    _all_serving(fuzz_stack)


def _all_serving(stack) -> None:
    statuses = {service: health_status(stack.target(service), timeout=5) for service in SERVICES}
    assert statuses == dict.fromkeys(SERVICES, health_pb2.HealthCheckResponse.SERVING), statuses
    dead = {name: p.returncode for name, p in stack.processes.items() if p.poll() is not None}
    assert not dead, dead


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _refusal(service, **fields) -> list[tuple[str, str]]:
    with pytest.raises(grpc.RpcError) as raised:
        service.Submit(inference_pb2.SubmitRequest(request=common_pb2.InferenceRequest(**fields)), timeout=30)
    _check_refusal(raised.value)
    return field_violations(raised.value)


def test_the_hostile_requests_of_the_report_are_refused_by_field(fuzz_stack, stub):
    service, _ = stub
    pids = {name: fuzz_stack.processes[name].pid for name in ("reception", "engine")}
    # 16 stop strings of a million characters: once 22.8 GB in the engine, OOM-killed
    stops = _refusal(service, prompt="hi", stop=["x" * 1_000_000] * 16)
    # every one is refused; the error carries the first MAX_VIOLATIONS_SENT of them
    assert [field for field, _ in stops] == [f"request.stop[{i}]" for i in range(errors.MAX_VIOLATIONS_SENT)]
    before = {name: _rss_mb(pid) for name, pid in pids.items()}
    # then 200 requests with one (200 MB sent): reception's memory levels off (the refused requests
    # are freed, some only by the cyclic GC) instead of growing with what it was sent, and the
    # engine never sees them
    for _ in range(200):
        _refusal(service, prompt="hi", stop=["x" * 1_000_000])
    after = {name: _rss_mb(pid) for name, pid in pids.items()}
    assert after["reception"] - before["reception"] < 100, (before, after)
    assert after["engine"] - before["engine"] < 5, (before, after)
    # "{prompt}" x 1000 over a 100,000-character prompt: once 500 MB in the router, then a failed job
    assert _refusal(service, prompt="p" * 100_000, template="{prompt}" * 1000)[0][0] == "request.template"
    # a schema nested far beyond the recursion limit: once INTERNAL (RecursionError)
    deep = '{"items": ' * 5_000 + "{}" + "}" * 5_000
    assert _refusal(service, prompt="hi", json_schema=deep)[0][0] == "request.json_schema"
    # 1,000 forced experts: once RESOURCE_EXHAUSTED (the error overflowed the client's metadata limit)
    forced = _refusal(service, prompt="hi", force_experts=[f"e{i}" for i in range(1000)])
    assert ("request.force_experts", "at most 10 experts, got 1000") in forced


# -- every method of every public service ----------------------------------------------------------

METHOD_EXAMPLES = 1000
METHOD_BUDGET_S = 75.0  # then the examples left are skipped (tests/helpers/fuzzing.py's Budget)
# What a fuzzed call must never get: a server fault, or no answer (a unary call's deadline passed).
FAULTS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)
CALL_TIMEOUT_S = 60.0
# Every fuzzed call carries the internal token: with auth off only the key RPCs check it, and with it
# they parse and validate what they are sent instead of refusing the caller first.
TOKEN = "fuzz-internal-token-0123456789abcdef"
CREDENTIALS = credentials_metadata(internal_token=TOKEN)


def _public_methods() -> list[descriptor.MethodDescriptor]:
    """Every method of every service of the public protos (those the SDK ships)."""
    methods = []
    for proto in PUBLIC:  # libs.gen.expert.v1 re-exports the SDK's modules of the public protos
        module = getattr(gen, proto.removeprefix("expert/v1/").removesuffix(".proto") + "_pb2")
        for service in module.DESCRIPTOR.services_by_name.values():
            methods.extend(service.methods)
    return methods


def _call(channel: grpc.Channel, method: descriptor.MethodDescriptor, request: bytes) -> bytes | None:
    """Call `method` with the serialized `request`: a unary call's answer; of a stream, its first
    two messages are read and the stream is then cancelled (which cancels its job)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    if not method.server_streaming:
        return channel.unary_unary(path)(request, timeout=CALL_TIMEOUT_S, metadata=CREDENTIALS)
    stream = channel.unary_stream(path)(request, timeout=CALL_TIMEOUT_S, metadata=CREDENTIALS)
    try:
        for _, _ in zip(range(2), stream, strict=False):
            pass
    finally:
        stream.cancel()
    return None


def _check_no_fault(method: descriptor.MethodDescriptor, error: grpc.RpcError) -> None:
    code = error.code()
    if code is grpc.StatusCode.CANCELLED:  # a stream this test cancelled
        return
    where = f"{method.containing_service.name}.{method.name}"
    assert code not in FAULTS, f"{where}: {code.name}: {(error.details() or '')[:300]}"
    # an error whose details overflowed the client's metadata limit reads as RESOURCE_EXHAUSTED
    assert "metadata" not in (error.details() or ""), f"{where}: {code.name}: {error.details()[:300]}"


def _cancel_submitted(
    channel: grpc.Channel, method: descriptor.MethodDescriptor, answer: bytes | None
) -> None:
    """An accepted Submit's job, cancelled so that the engine spends no time on it."""
    if answer is None or method.full_name != "expert.v1.InferenceService.Submit":
        return
    job_id = inference_pb2.SubmitResponse.FromString(answer).submission.job_id
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    stub.CancelJob(inference_pb2.CancelJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_S)


def test_every_public_method_answers_random_messages_without_a_fault(fuzz_stack, stub, request):
    """Random messages built from each method's input descriptor (any enum number, numbers at and
    past their bounds, long text, lone surrogates in strings): every answer is a result or a client
    error, never INTERNAL, UNKNOWN or a unary call left unanswered. The seed is printed (replay:
    EXPERT_FUZZ_SEED, docs/operations.md#fuzzing)."""
    _, channel = stub
    methods = _public_methods()
    assert {m.containing_service.name for m in methods} >= {
        "InferenceService",
        "SessionService",
        "KeyService",
    }
    budget = Budget(METHOD_BUDGET_S)
    calls = st.sampled_from(methods).flatmap(
        lambda m: st.tuples(st.just(m), messages(GetMessageClass(m.input_type)))
    )

    @seed(fuzz_seed(request.config))
    @settings(
        max_examples=METHOD_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(calls)
    def call(fuzzed):
        method, message = fuzzed
        if budget.spent():
            return
        data = with_surrogates(message.SerializeToString())
        try:
            _cancel_submitted(channel, method, _call(channel, method, data))
        except grpc.RpcError as error:
            _check_no_fault(method, error)

    call()
    print(f"gRPC method fuzz: {budget.ran} calls over {len(methods)} methods, {budget.skipped} skipped")
    _all_serving(fuzz_stack)


@pytest.mark.parametrize(
    "method",
    [
        "expert.v1.InferenceService/GetJob",
        "expert.v1.SessionService/GetSession",
        "expert.v1.KeyService/CreateKey",
        "expert.v1.TrainingService/GetTrainingJob",
        "expert.v1.TrainingFileService/GetTrainingFile",
    ],
)
def test_bad_utf8_is_refused_by_field_on_every_public_service(stub, method):
    """A string field that is not UTF-8 (a lone surrogate's bytes) is INVALID_ARGUMENT naming the
    request, on a method of each public service whose field 1 is a string."""
    _, channel = stub
    field_1 = b"\x0a\x03" + with_surrogates(SURROGATE_STAND_IN.encode())  # field 1 (a string): a surrogate
    with pytest.raises(grpc.RpcError) as raised:
        channel.unary_unary(f"/{method}")(field_1, timeout=CALL_TIMEOUT_S, metadata=CREDENTIALS)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
