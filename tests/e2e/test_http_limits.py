"""Reception's HTTP front against hostile bodies, on a real stack with EXPERT_AUTH=required: bodies
past EXPERT_HTTP_MAX_BODY_BYTES refused unread (413) before the key is checked, with reception's
memory flat; text no UTF-8 can carry refused by field; bodies no parser should see refused in
OpenAI's shape; and the gRPC front's message size bound (docs/operations.md#failure-modes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from libs.grpc_client import MAX_MESSAGE_BYTES
from tests.e2e.conftest import ready_tiny_stack

TOKEN = "e2e-internal-token-0123456789abcdef"
INTERNAL = dict(credentials_metadata(internal_token=TOKEN))  # a credential the HTTP front accepts too
LIMIT = 1024 * 1024  # EXPERT_HTTP_MAX_BODY_BYTES here
MB = 1024 * 1024


@pytest.fixture(scope="module")
def secured(tiny_llama, tmp_path_factory):
    settings = {
        "EXPERT_AUTH": "required",
        "EXPERT_INTERNAL_TOKEN": TOKEN,
        "EXPERT_HTTP_MAX_BODY_BYTES": str(LIMIT),
    }
    with ready_tiny_stack(tiny_llama, tmp_path_factory.mktemp("http-limits"), **settings) as stack:
        yield stack


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _chat_body(size: int) -> Iterator[bytes]:
    """A chat body of about `size` bytes, made as it is sent: the test never holds it."""
    yield b'{"model": "m", "messages": [{"role": "user", "content": "'
    chunk = b"x" * MB
    for _ in range(size // MB):
        yield chunk
    yield b'"}]}'


def _post(url: str, content, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(url + "/v1/chat/completions", content=content, headers=headers, timeout=120)


def _too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error", error
    assert "EXPERT_HTTP_MAX_BODY_BYTES" in error["message"]


def test_a_300_mb_body_without_a_key_is_refused_unread_with_memory_flat(secured):
    url, pid = secured.http_url(), secured.processes["reception"].pid
    assert _post(url, b"{}").status_code == 401  # no key: the body within bounds reaches the key check
    before = _rss_mb(pid)
    # streamed without a Content-Length (chunked): refused at the first megabyte over
    _too_large(_post(url, _chat_body(300 * MB)))
    # with its Content-Length: refused before one byte of it is read
    declared = {"content-length": str(300 * MB + 42)}
    _too_large(_post(url, _chat_body(300 * MB), declared))
    after = _rss_mb(pid)
    assert after - before < 50, (before, after)


def test_bodies_near_the_limit_with_a_key_give_their_memory_back(secured):
    """Rounds of 8 bodies just under the limit at once, with a credential: each is parsed and
    refused by validation (a 1 MB prompt), and reception's memory returns to where it was."""
    url, pid = secured.http_url(), secured.processes["reception"].pid
    model = httpx.get(url + "/v1/models", headers=INTERNAL, timeout=10).json()["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "y" * (LIMIT - 100)}).encode()
    headers = {"content-type": "application/json", **INTERNAL}

    def post(_) -> httpx.Response:
        return httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=60)

    warm = post(None)
    assert warm.status_code == 400 and warm.json()["error"]["param"] == "prompt", warm.text[:300]
    before = _rss_mb(pid)
    for _ in range(4):  # 32 MB sent
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
        assert [a.status_code for a in answers] == [400] * 8
    after = _rss_mb(pid)
    # once 6 MB more per round, until the cyclic GC ran: a refused call's exception held its body
    assert after - before < 15, (before, after)


# Every string field of the OpenAI routes and the REST API, each with a lone surrogate in turn.
S = "hi \ud800"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _schema_format(**json_schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, **json_schema}}


SURROGATES = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": S, "content": "hi"}]}, "messages[0].role"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": S}]}]},
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", {**CHAT, "model": S}, "model"),
    ("/v1/chat/completions", {**CHAT, "stop": S}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", S]}, "stop[1]"),
    ("/v1/chat/completions", {**CHAT, "user": S}, "user"),
    ("/v1/chat/completions", {**CHAT, "force_experts": [S]}, "force_experts[0]"),
    ("/v1/chat/completions", {**CHAT, "exclude_experts": [S]}, "exclude_experts[0]"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": S}}, "response_format.type"),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "regex", "regex": S}},
        "response_format.regex",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "grammar", "grammar": S}},
        "response_format.grammar",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": _schema_format(name=S)},
        "response_format.json_schema.name",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": _schema_format(description=S)},
        "response_format.json_schema.description",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": _schema_format(schema={"properties": {S: {"type": "string"}}})},
        "response_format.json_schema.schema.properties",  # the object holding the key
    ),
    ("/v1/completions", {**COMPLETION, "prompt": S}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [S]}, "prompt[0]"),
    ("/v1/completions", {**COMPLETION, "suffix": S}, "suffix"),
    ("/v1/completions", {**COMPLETION, "model": S}, "model"),
    ("/v1/infer", {"prompt": S}, "prompt"),
    ("/v1/infer", {"prompt": "hi", "template": S}, "template"),
    ("/v1/infer", {"prompt": "hi", "body": S}, "body"),
    ("/v1/infer", {"prompt": "hi", "user_id": S}, "user_id"),
    ("/v1/infer", {"prompt": "hi", "json_schema": S}, "json_schema"),
    ("/v1/infer", {"prompt": "hi", "stop": [S]}, "stop[0]"),
    ("/v1/infer", {"messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("/v1/jobs", {"prompt": "hi", "model": S}, "model"),
]


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_a_lone_surrogate_in_any_string_field_is_a_400_naming_it(secured, path, body, param):
    content = json.dumps(body)  # the surrogate escaped as JSON allows ("\ud800")
    headers = {"content-type": "application/json", **INTERNAL}
    response = httpx.post(secured.http_url() + path, content=content, headers=headers, timeout=30)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"], error


@pytest.mark.parametrize(
    "content, says",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
        ('{"model": "m", "messages": ' + "[" * 200 + "]" * 200 + "}", "nested deeper than"),
        (b'{"model": "m\xff\xfe", "prompt": "hi"}', "utf-8"),
        ('{"model": "m", "prompt": "hi", "seed": ' + "9" * 5000 + "}", "digits"),
        ('{"model": "m", "prompt": ', "Expecting value"),
    ],
    ids=["100000-deep", "200-deep", "invalid-utf8", "5000-digit-number", "truncated"],
)
def test_a_body_no_parser_should_see_is_refused_in_openais_shape(secured, content, says):
    headers = {"content-type": "application/json", **INTERNAL}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/infer"):
        response = httpx.post(secured.http_url() + path, content=content, headers=headers, timeout=30)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and says in error["message"], error


def test_a_grpc_message_over_the_receive_limit_is_resource_exhausted(secured):
    """The gRPC fronts take messages up to MAX_MESSAGE_BYTES (64 MiB, libs/grpc_client.py); one
    over it is refused by the transport, before any handler or the key check, and costs nothing."""
    pid = secured.processes["reception"].pid
    before = _rss_mb(pid)
    request = common_pb2.InferenceRequest(prompt="p" * (MAX_MESSAGE_BYTES + 1))
    with grpc.insecure_channel(secured.target("reception")) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Submit(inference_pb2.SubmitRequest(request=request), timeout=60)
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value.details()
    del request
    assert _rss_mb(pid) - before < 50
