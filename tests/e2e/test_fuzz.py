"""Hostile input against a real stack: random requests (hypothesis) at reception's public API.

Every answer is either an accepted job or INVALID_ARGUMENT naming a field; never INTERNAL, UNKNOWN,
a metadata overflow or a hang; and every service still reports SERVING afterwards. Accepted jobs
are cancelled at once, so the engine spends no time on them. The HTTP routes get random JSON the
same way (lone surrogates, nesting, huge numbers, wrong types): a 4xx in OpenAI's shape or a job.
"""

from __future__ import annotations

import json

import grpc
import httpx
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


# -- the HTTP routes -------------------------------------------------------------------------------

# Strings as JSON carries them, lone surrogates included (valid JSON, not valid text).
_HTTP_TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["hi \ud800", "\udfff", "a\ud83d b"]))
# Any JSON value: huge and non-finite numbers, nesting, the wrong types for every field.
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**40), 10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _HTTP_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_HTTP_TEXT, inner, max_size=3),
    max_leaves=8,
)
_DEEP = st.builds(
    lambda depth: [[]] if depth == 0 else json.loads("[" * depth + "]" * depth), st.integers(1, 900)
)


def _field(right: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly of its type, else anything JSON holds."""
    return st.one_of(right, right, _JSON, _DEEP)


_HTTP_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": _field(st.sampled_from(ROLES)), "content": _field(_HTTP_TEXT)}), max_size=3
)
_HTTP_OPTIONAL = {
    "max_tokens": _field(st.integers(-5, 10**12)),
    "temperature": _field(st.floats(-3, 3)),
    "top_p": _field(st.floats(-1, 2)),
    "stop": _field(st.one_of(_HTTP_TEXT, st.lists(_HTTP_TEXT, max_size=3))),
    "seed": _field(st.integers(-1, 2**65)),
    "user": _field(_HTTP_TEXT),
    "n": _field(st.integers(-2, 20)),
    "top_k": _field(st.integers(-2, 10**10)),
    "force_experts": _field(st.lists(_HTTP_TEXT, max_size=2)),
    "response_format": _field(
        st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "regex", "grammar"])}),
            st.fixed_dictionaries({"type": st.just("regex"), "regex": _field(_HTTP_TEXT)}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": _field(st.fixed_dictionaries({"name": _HTTP_TEXT, "schema": _JSON})),
                }
            ),
        )
    ),
    "priority": _field(st.integers(-1, 12)),
    "logprobs": _field(st.booleans()),
}


def _openai_bodies(model: str) -> st.SearchStrategy[tuple[str, dict]]:
    """(route, body): a valid request (so that some are accepted) with random fields over it."""
    models = st.one_of(
        st.just(model), st.just(model), _field(st.sampled_from([f"{model}:nobody", "no-such"]))
    )
    hello = [{"role": "user", "content": "hi"}]
    extra = st.one_of(st.just({}), st.fixed_dictionaries({}, optional=_HTTP_OPTIONAL))
    chat = st.builds(
        lambda model, messages, more: {"model": model, "messages": messages, "max_tokens": 4, **more},
        models,
        st.one_of(st.just(hello), _field(_HTTP_MESSAGES)),
        extra,
    )
    completion = st.builds(
        lambda model, prompt, more: {"model": model, "prompt": prompt, "max_tokens": 4, **more},
        models,
        st.one_of(st.just("hi"), _field(st.one_of(_HTTP_TEXT, st.lists(_HTTP_TEXT, max_size=2)))),
        extra,
    )
    return st.one_of(
        st.tuples(st.just("/v1/chat/completions"), chat), st.tuples(st.just("/v1/completions"), completion)
    )


def _check_http_refusal(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert response.headers["content-type"] == "application/json", response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error


def test_random_http_bodies_are_accepted_or_refused_in_openais_shape(fuzz_stack):
    """OpenAI's routes and the REST API with random bodies: accepted (a stream, closed at once,
    which cancels its job), or refused with a 4xx in OpenAI's shape; never a 500 or plain text."""
    url = fuzz_stack.http_url()
    with httpx.Client(base_url=url, timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        seen = {"accepted": 0, "refused": 0}

        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(_openai_bodies(model), st.booleans())
        def post(route, rest):
            path, body = route
            if rest:  # the same fields on the REST API, where they exist under these names
                path = "/v1/jobs"
            content = json.dumps({**body, "stream": True} if not rest else body)
            headers = {"content-type": "application/json"}
            with http.stream("POST", path, content=content, headers=headers) as response:
                if response.status_code in (200, 202):
                    seen["accepted"] += 1
                    if rest:
                        http.delete(f"/v1/jobs/{json.loads(response.read())['job_id']}")
                    return  # a stream closed here cancels its job
                response.read()
                _check_http_refusal(response)
                seen["refused"] += 1

        post()
    print(f"HTTP fuzz: {seen}")
    assert seen["accepted"] and seen["refused"], seen
    _all_serving(fuzz_stack)
