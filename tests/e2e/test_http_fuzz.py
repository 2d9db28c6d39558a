"""Reception's HTTP API fuzzed from its own OpenAPI document, against a real stack: schemathesis reads
/openapi.json and generates requests for every operation (OpenAI's chat, completions, models and
Responses, the Files and fine-tuning APIs, the REST and training routes, the probes), both
schema-valid ones and ones that break the schema; a layer of this test then puts into the JSON
bodies what no schema yields: lone surrogates as JSON escapes them (`"\\ud800"`), nesting just under
and far past the bound, numbers past every integer and float type, very long text. No answer may be
a 500, an error that is not OpenAI's JSON body, or no answer at all.

Why schemathesis rather than Hypothesis over hypothesis-jsonschema: it reads the whole document (path
and query parameters, multipart uploads, `$ref`s between schemas) where hypothesis-jsonschema covers
one JSON schema at a time and would leave the rest to hand-written code; it installs beside the
project's pins (4.32.5: no package changed, measured with `pip install --dry-run`); and its
strategies are plain Hypothesis strategies, so the seed, the budget and the hostile values are this
test's own. Generating a case costs about a millisecond, nothing beside the stack's answer.

The seed is printed; `EXPERT_FUZZ_SEED=<seed>` (or `--hypothesis-seed=<seed>`) replays a run
(docs/operations.md#fuzzing)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import requests
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from tests.e2e.conftest import stack_env
from tests.helpers.fuzzing import Budget, fuzz_seed
from tools.stack import SERVICES, LocalStack, health_status

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # schemathesis warns about its own optional extras on import
    import schemathesis
    from schemathesis import GenerationMode

EXAMPLES = 2000
BUDGET_S = 90.0  # then the examples left are skipped
TIMEOUT_S = (10.0, 60.0)  # (connect, read): an answer slower than this is a hang
# Raw JSON no schema generates. The depths go either side of body_guard.py's MAX_JSON_DEPTH (128)
# once inside a request; the numbers pass int32, int64, uint64 and float64.
HOSTILE = (
    '"\\ud800"',
    '"a\\udfff b"',
    '"\\ud83d"',
    '"\\u0000"',
    "1e400",
    "-1e400",
    "4.9e-325",
    "1" + "0" * 400,
    "18446744073709551616",
    "-9223372036854775809",
    "2147483648",
    "[" * 120 + "]" * 120,
    '{"a": ' * 120 + "1" + "}" * 120,
    "[" * 5_000 + "]" * 5_000,
    "null",
    "true",
    '""',
    "[]",
    "{}",
    '"' + "x" * 600_000 + '"',
)
_MARK = "\u0000fuzz\u0000"  # stands for a hostile value until the body is JSON text
_MARK_JSON = json.dumps(_MARK)


@pytest.fixture(scope="module")
def http_fuzz_stack(tiny_llama, tmp_path_factory):
    # A short context: every job the fuzzer gets accepted ends within seconds.
    env = stack_env(
        tiny_llama, EXPERT_MAX_MODEL_LEN="256", EXPERT_KV_NUM_BLOCKS="160", EXPERT_MAX_NUM_SEQS="4"
    )
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("http-fuzz"), env=env)
    stack.start()
    yield stack
    stack.stop()


def _body_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """The path of every value in a JSON body (the body itself first), and of a new key in each object."""
    paths = [path]
    if isinstance(value, dict):
        paths.append((*path, "fuzz_extra"))
        for key, item in value.items():
            paths.extend(_body_paths(item, (*path, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths.extend(_body_paths(item, (*path, index)))
    return paths


def _with_mark(body: Any, path: tuple) -> Any:
    if not path:
        return _MARK
    container = body
    for step in path[:-1]:
        container = container[step]
    container[path[-1]] = _MARK
    return body


@st.composite
def _json_text(draw, body: Any) -> str:
    """`body` as JSON text, mostly with one of its values (or the whole body, or a new key) made
    a hostile one."""
    if draw(st.integers(0, 3)) == 0:
        return json.dumps(body)
    copy = json.loads(json.dumps(body))
    path = draw(st.sampled_from(_body_paths(copy)))
    text = json.dumps(_with_mark(copy, path))
    return text.replace(_MARK_JSON, draw(st.sampled_from(HOSTILE)))


def _send(session: requests.Session, case, data: st.DataObject, url: str) -> requests.Response:
    """The case as schemathesis would send it, its JSON body (if any) through _json_text."""
    kwargs = case.as_transport_kwargs(base_url=url)
    if "json" in kwargs:
        text = data.draw(_json_text(kwargs.pop("json")), label="body")
        kwargs["data"] = text.encode()  # ASCII: json.dumps escapes the rest
        kwargs["headers"] = {**kwargs.get("headers", {}), "Content-Type": "application/json"}
    else:
        note(f"request: {kwargs['method']} {kwargs['url']}")
    return session.request(**kwargs, timeout=TIMEOUT_S, stream=True)


def _check(case, response: requests.Response) -> None:
    """No 500 (any 5xx but a 503 or 507, which say what to do), and every error in OpenAI's shape."""
    where = f"{case.method} {case.formatted_path} -> {response.status_code}"
    status = response.status_code
    assert status < 500 or status in (503, 507), f"{where}: {response.text[:300]}"
    if status < 400 or case.method.upper() == "HEAD" or case.path == "/health":
        return  # a HEAD answer has no body; /health answers with a bare status (vLLM's probe)
    assert response.headers.get("content-type", "").startswith("application/json"), (
        f"{where}: {response.text[:300]}"
    )
    error = response.json().get("error")
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), f"{where}: {error}"


def _end_accepted(session: requests.Session, url: str, case, response: requests.Response) -> None:
    """An accepted stream is closed unread (which cancels its job); a queued REST job is cancelled."""
    if case.path == "/v1/jobs" and response.status_code == 202:
        session.delete(f"{url}/v1/jobs/{response.json()['job_id']}", timeout=TIMEOUT_S)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        response.close()
        return
    response.content  # noqa: B018 - read within the timeout: a body that never ends is a hang


def test_every_http_operation_answers_fuzzed_requests_without_a_500(http_fuzz_stack, request):
    url = http_fuzz_stack.http_url()
    schema = schemathesis.openapi.from_dict(requests.get(url + "/openapi.json", timeout=10).json())
    operations = [result.ok() for result in schema.get_all_operations()]
    modes = st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    cases = st.tuples(st.sampled_from(operations), modes).flatmap(
        lambda pair: pair[0].as_strategy(generation_mode=pair[1])
    )
    budget, seen, statuses = Budget(BUDGET_S), {}, {}

    @seed(fuzz_seed(request.config))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases, st.data())
    def call(case, data):
        if budget.spent():
            return
        with requests.Session() as session:
            response = _send(session, case, data, url)
            _check(case, response)
            _end_accepted(session, url, case, response)
        seen[case.path] = seen.get(case.path, 0) + 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    call()
    print(f"HTTP fuzz: {budget.ran} requests, {budget.skipped} skipped; statuses {statuses}; per path {seen}")
    assert len(seen) >= len({op.path for op in operations}) // 2, seen  # the budget reached most routes
    statuses = {service: health_status(http_fuzz_stack.target(service), timeout=5) for service in SERVICES}
    assert set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}, statuses
