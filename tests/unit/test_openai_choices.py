"""OpenAI's `n`, logprobs and `response_format` in reception's HTTP front, in process over a fake
admission core: the mapping onto the InferenceRequest, and the choices and logprobs of the answer parsed
by the `openai` package's own types (tests/e2e/test_openai_choices.py runs them on a real stack)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from libs.gen.expert.v1 import common_pb2
from services.reception.http import create_app
from services.reception.http.errors import HttpError
from services.reception.http.openai_request import to_request
from services.reception.http.openai_schema import ChatCompletionRequest, CompletionRequest
from tests.unit.test_http_api import CHAT, FakeAdmission, FakeCapacity, FakeModels


def _token(text: str, logprob: float, *alternatives: tuple[str, float]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token=text,
        logprob=logprob,
        token_bytes=text.encode(),
        top_logprobs=[
            common_pb2.TopLogprob(token=t, logprob=lp, token_bytes=t.encode()) for t, lp in alternatives
        ],
    )


TOKENS = [
    _token("Pa", -0.5, ("Pa", -0.5), ("Lo", -1.5)),
    _token("ris", -0.25, ("ris", -0.25), ("ndon", -2.0)),
]


@pytest.fixture
def parts():
    admission = FakeAdmission()
    admission.result.finish_reason = common_pb2.FINISH_REASON_STOP
    admission.result.choices.extend(
        [
            common_pb2.Choice(
                index=0, text="Paris", finish_reason=common_pb2.FINISH_REASON_STOP, logprobs=TOKENS
            ),
            common_pb2.Choice(
                index=1,
                text="Paris",
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                logprobs=TOKENS,
                validation=common_pb2.ValidationResult(
                    valid=False, validator="json_schema", error="not JSON"
                ),
            ),
        ]
    )
    return admission, TestClient(create_app(admission, FakeCapacity(), FakeModels()))


def test_n_logprobs_and_response_format_map_onto_the_request():
    chat = to_request(
        ChatCompletionRequest(
            **CHAT, n=3, logprobs=True, top_logprobs=4, response_format={"type": "json_object"}
        )
    )
    assert (chat.n, chat.logprobs) == (3, 4)
    assert chat.response_format == common_pb2.ResponseFormat(json_object={})
    assert not chat.HasField("json_schema")  # the shorthand is the gRPC API's, not OpenAI's
    assert to_request(ChatCompletionRequest(**CHAT, logprobs=True)).logprobs == 0
    plain = to_request(ChatCompletionRequest(**CHAT, logprobs=False, response_format={"type": "text"}))
    assert (
        not plain.HasField("logprobs") and not plain.HasField("response_format") and not plain.HasField("n")
    )
    schema = {"type": "object", "required": ["city"]}
    completion = to_request(
        CompletionRequest(
            model="base",
            prompt="p",
            logprobs=2,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": schema, "strict": True},
            },
        )
    )
    assert completion.logprobs == 2
    spec = completion.response_format.json_schema
    assert (spec.name, json.loads(spec.schema), spec.strict) == ("c", schema, True)


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "regex", "regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
        ({"type": "grammar", "grammar": 'start: "yes" | "no"'}, {"grammar": 'start: "yes" | "no"'}),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "description": "what for"}},
            {"json_schema": {"name": "n", "schema": "{}", "description": "what for"}},
        ),
    ],
)
def test_the_regex_and_grammar_extensions_and_a_described_schema_map_onto_the_format(
    response_format, expected
):
    request = to_request(ChatCompletionRequest(**CHAT, response_format=response_format))
    assert request.response_format == common_pb2.ResponseFormat(**expected)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "regex"}}, "response_format.regex"),
        ({"response_format": {"type": "regex", "regex": ["a"]}}, "response_format.regex"),
        ({"response_format": {"type": "grammar", "grammar": None}}, "response_format.grammar"),
        ({"response_format": {"type": "regex", "regex": "a", "grammar": "b"}}, "response_format.grammar"),
        ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "response_format.json_schema.schema",  # OpenAI's schema is an object, not its text
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "description": 1},
                }
            },
            "response_format.json_schema.description",
        ),
        ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict": 1},
                }
            },
            "response_format.json_schema.strict",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "extra": 1},
                }
            },
            "response_format.json_schema.extra",
        ),
    ],
)
def test_bad_logprobs_or_response_format_name_the_param(fields, param):
    with pytest.raises(HttpError) as caught:
        to_request(ChatCompletionRequest(**CHAT, **fields))
    assert caught.value.status == 400 and caught.value.param == param


def test_the_chat_answer_has_every_choice_with_logprobs_in_openais_types(parts):
    admission, http = parts
    body = http.post(
        "/v1/chat/completions", json={**CHAT, "n": 2, "logprobs": True, "top_logprobs": 2}
    ).json()
    response = ChatCompletion.model_validate(body)
    assert [(c.index, c.finish_reason) for c in response.choices] == [(0, "stop"), (1, "length")]
    content = response.choices[1].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [
        ("Pa", -0.5, list(b"Pa")),
        ("ris", -0.25, list(b"ris")),
    ]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Pa", -0.5), ("Lo", -1.5)]
    assert body["expert_system"]["validation"][1] == {
        "index": 1,
        "valid": False,
        "validator": "json_schema",
        "error": "not JSON",
    }
    assert admission.requests[-1].n == 2 and admission.requests[-1].logprobs == 2
    without = http.post("/v1/chat/completions", json=CHAT).json()
    assert all(c["logprobs"] is None for c in without["choices"])


def test_the_completion_answer_has_openais_parallel_logprob_lists(parts):
    _, http = parts
    body = http.post("/v1/completions", json={"model": "base", "prompt": "p", "n": 2, "logprobs": 2}).json()
    logprobs = Completion.model_validate(body).choices[0].logprobs
    assert logprobs.tokens == ["Pa", "ris"] and logprobs.token_logprobs == [-0.5, -0.25]
    assert logprobs.top_logprobs == [{"Pa": -0.5, "Lo": -1.5}, {"ris": -0.25, "ndon": -2.0}]
    assert logprobs.text_offset == [0, 2]


def _events(response) -> list[dict | str]:
    """The server-sent events of a streamed answer: each `data:` as JSON, `[DONE]` as it is."""
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_a_streamed_chat_sends_each_choices_role_text_finish_and_the_usage_in_openais_types(parts):
    admission, http = parts
    body = {**CHAT, "n": 2, "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(http.post("/v1/chat/completions", json=body))
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert {c.id for c in chunks} == {"chatcmpl-j1"}
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    texts = [(c.choices[0].index, c.choices[0].delta.content) for c in chunks[2:6]]
    assert texts == [(0, "Pa"), (0, "ris"), (1, "Pa"), (1, "ris")]
    assert chunks[2].choices[0].logprobs.content[0].token == "Pa"
    finished = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks[6:8]]
    assert finished == [(0, "stop"), (1, "length")]
    assert events[7]["expert_system"]["validation"][1]["valid"] is False
    assert chunks[8].choices == [] and chunks[8].usage.total_tokens == 9
    assert admission.requests[-1].n == 2


def test_a_streamed_completion_counts_each_choices_text_offset(parts):
    _, http = parts
    body = {"model": "base", "prompt": "p", "n": 2, "logprobs": 1, "stream": True}
    events = _events(http.post("/v1/completions", json=body))
    offsets = [(e["choices"][0]["index"], e["choices"][0]["logprobs"]["text_offset"]) for e in events[:4]]
    assert offsets == [(0, [0]), (0, [2]), (1, [0]), (1, [2])]
    finished = [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in events[4:6]]
    assert finished == [(0, "stop"), (1, "length")] and events[6:] == ["[DONE]"]
    assert {e["id"] for e in events[:-1]} == {"cmpl-j1"} and events[0]["object"] == "text_completion"


def test_a_stream_whose_job_restarts_after_text_was_sent_ends_with_an_error_event(parts):
    admission, http = parts
    admission.restart = True
    events = _events(http.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True}))
    assert (
        events[-1]["error"]["code"] == "job_restarted"
        and events[-1]["error"]["type"] == "service_unavailable_error"
    )
    assert "[DONE]" not in events
