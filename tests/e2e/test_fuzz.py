"""Hostile input against a real stack: random requests (hypothesis) at reception's public API.

Every answer is either an accepted job or INVALID_ARGUMENT naming a field; never INTERNAL, UNKNOWN,
a metadata overflow or a hang; and every service still reports SERVING afterwards. Accepted jobs
are cancelled at once, so the engine spends no time on them.
"""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs import errors
from libs.errors import field_violations
from libs.gen.expert.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.conftest import stack_env
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
        tiny_llama, EXPERT_MAX_MODEL_LEN="1024", EXPERT_KV_NUM_BLOCKS="160", EXPERT_MAX_NUM_SEQS="4"
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
