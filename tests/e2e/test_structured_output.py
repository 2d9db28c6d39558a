"""Structured output (docs/api.md#structured-output) against a real stack on the tiny model: each kind
of format through reception's gRPC API (the SDK), the official `openai` client and the REST API;
refusals that name the part at fault; and each output checked by its format's validator.

Until the engine enforces formats (it is being built on main), the tiny model's random output does
not follow them: the accepted requests assert only what holds regardless of enforcement (the job
completes, the plan carries the format, postproc checks the output with the right validator), and
`test_each_kind_is_enforced_end_to_end` is expected to fail.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from expert_system import ExpertClient, InvalidRequest
from libs.structured_output import StructuredOutput, text_problem
from tests.e2e.conftest import openai_client
from tools.stack import LocalStack

PROMPT = "Is Paris the capital of France?"
MAX_TOKENS = 32
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
PHONE = "[0-9]{3}-[0-9]{4}"
YES_OR_NO = 'start: "yes" | "no"'

# (SDK keywords, the format libs.structured_output reads it as, postproc's validator)
KINDS = {
    "json_object": (
        {"response_format": {"type": "json_object"}},
        StructuredOutput("json_object"),
        "json_schema",
    ),
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
            }
        },
        StructuredOutput("json_schema", json.dumps(ANSWER_SCHEMA)),
        "json_schema",
    ),
    "json_schema shorthand": (
        {"json_schema": ANSWER_SCHEMA},
        StructuredOutput("json_schema", json.dumps(ANSWER_SCHEMA)),
        "json_schema",
    ),
    "regex": ({"regex": PHONE}, StructuredOutput("regex", PHONE), "regex"),
    "grammar": ({"grammar": YES_OR_NO}, StructuredOutput("grammar", YES_OR_NO), "grammar"),
}
# The same formats as OpenAI's response_format (with the regex and grammar extensions).
OPENAI_FORMATS = {
    "json_object": ({"type": "json_object"}, "json_schema"),
    "json_schema": (
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
        "json_schema",
    ),
    "regex": ({"type": "regex", "regex": PHONE}, "regex"),
    "grammar": ({"type": "grammar", "grammar": YES_OR_NO}, "grammar"),
}


@pytest.fixture(scope="module")
def stack(shared_tiny_stack) -> LocalStack:
    return shared_tiny_stack  # it only sends requests: the session's shared stack serves


@pytest.fixture(scope="module")
def client(stack) -> ExpertClient:
    with ExpertClient(stack.target("reception")) as client:
        yield client


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    with openai_client(stack) as client:
        yield client


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def _infer(client: ExpertClient, keywords: dict):
    return client.infer(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, timeout=60, **keywords)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_runs_and_is_checked_by_its_validator(client, kind):
    keywords, output_format, validator = KINDS[kind]
    result = _infer(client, keywords)
    assert result.status == "completed", result.error
    assert result.validation.validator == validator
    assert [c.validation.validator for c in result.choices] == [validator]
    task = "json_parsing" if output_format.is_json else "structured_output"
    trace = result.reasoning_trace
    assert f"task {task} (the request's {output_format.kind} format" in trace
    assert f"format: {output_format.kind} (the request's " in trace


@pytest.mark.parametrize(
    ("keywords", "field", "says"),
    [
        ({"regex": "a(?=b)"}, "request.response_format.regex", "look-around"),
        ({"regex": ""}, "request.response_format.regex", "must not be empty"),
        ({"grammar": "start: nowhere"}, "request.response_format.grammar", "unknown name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"not": {"type": "string"}}},
                }
            },
            "request.response_format.json_schema.schema",
            'Unimplemented keys: ["not"]',
        ),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "request.json_schema", "uniqueItems"),
        ({"json_schema": {"type": "object"}, "regex": "a+"}, "request.json_schema", "set either json_schema"),
    ],
)
def test_a_format_the_engine_cannot_enforce_is_refused_naming_its_part(client, keywords, field, says):
    with pytest.raises(InvalidRequest) as refused:
        _infer(client, keywords)
    violations = dict(refused.value.field_violations)
    assert list(violations) == [field] and says in violations[field]


@pytest.mark.parametrize("kind", list(OPENAI_FORMATS))
def test_each_kind_runs_through_the_openai_client(oai, model, kind):
    response_format, validator = OPENAI_FORMATS[kind]
    response = oai.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format=response_format,
    )
    body = response.http_response.json()
    assert [(v["index"], v["validator"]) for v in body["expert_system"]["validation"]] == [(0, validator)]
    assert response.parse().choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        ({"type": "regex", "regex": "a(?=b)"}, "response_format.regex", "look-around"),
        ({"type": "grammar", "grammar": ""}, "response_format.grammar", "must not be empty"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
            "response_format.json_schema.schema",
            'Unimplemented keys: ["not"]',
        ),
        ({"type": "regex"}, "response_format.regex", "must be a string"),
    ],
)
def test_a_refusal_is_openais_400_naming_the_part(oai, model, response_format, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            response_format=response_format,
        )
    error = refused.value.body
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and says in error["message"]


def test_the_rest_api_takes_a_format_and_names_a_refused_part(stack):
    with httpx.Client(base_url=stack.http_url(), timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        ran = http.post("/v1/infer", json={**body, "response_format": {"type": "regex", "regex": PHONE}})
        assert ran.status_code == 200 and ran.json()["validation"]["validator"] == "regex"
        refused = http.post(
            "/v1/jobs", json={**body, "response_format": {"type": "regex", "regex": "(a)\\1"}}
        )
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "response_format.regex"
        assert "backreferences are not supported" in error["message"]


def test_each_kind_is_enforced_end_to_end(client):
    for kind, (keywords, output_format, _) in KINDS.items():
        result = _infer(client, keywords)
        (choice,) = result.choices
        problem = text_problem(output_format, choice.text)
        if choice.finish_reason == "length":
            # cut by max_tokens: every byte so far was one the format allowed
            assert problem == "ends before the format is complete", (kind, choice.text)
            assert output_format.is_json, f"{kind}: a format of a few bytes ran to max_tokens"
            continue
        assert problem is None and choice.validation.valid, (kind, choice.text, choice.validation)
        if output_format.is_json:
            jsonschema.validate(json.loads(choice.text), json.loads(output_format.schema_text))
