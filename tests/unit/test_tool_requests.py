"""Tool calling at reception (docs/api.md#tool-calling): OpenAI's shapes parsed into the request
(a bad shape is a 400 naming its part), the validation rules (each violation naming its field),
and a result's calls in OpenAI's message (their streaming: tests/unit/test_tool_call_streaming.py)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from services.reception.admission.validation import validate
from services.reception.http import create_app
from services.reception.http.errors import HttpError, param_of
from services.reception.http.openai_request import to_request
from services.reception.http.openai_response import chat_message, legacy_call_delta
from services.reception.http.openai_schema import ChatCompletionRequest
from tests.unit.test_http_api import FakeAdmission, FakeCapacity, FakeModels

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": ADD}}


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **fields)


def test_openai_tools_map_onto_the_request():
    request = to_request(
        body(
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "add"}},
            parallel_tool_calls=False,
        )
    )
    assert request.tools[0].name == "add" and json.loads(request.tools[0].parameters) == ADD
    assert request.tool_choice.function == "add" and request.parallel_tool_calls is False
    assert (
        to_request(body(tools=[TOOL], tool_choice="required")).tool_choice.mode
        == common_pb2.TOOL_CHOICE_MODE_REQUIRED
    )
    assert not to_request(body(tools=[])).tools


def test_a_replayed_history_keeps_names_calls_and_ids():
    messages = [
        {"role": "user", "content": "Add 1", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
    ]
    request = to_request(ChatCompletionRequest(model="m", messages=messages, tools=[TOOL]))
    user, assistant, tool = request.messages
    assert user.name == "ann"
    assert assistant.content == "" and assistant.tool_calls[0].arguments == '{"a": 1}'
    assert tool.tool_call_id == "call_1"
    validate(request)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "other": 1}}]}, "tools[0].function.other"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}], "tools": [TOOL]}, "functions"),
        ({"function_call": "none", "tool_choice": "none"}, "function_call"),
        ({"functions": [{"name": "f"}], "parallel_tool_calls": True}, "functions"),
        ({"functions": [{"name": 3}]}, "functions[0].name"),
        ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call"),
    ],
)
def test_a_bad_shape_is_refused_naming_its_part(fields, param):
    with pytest.raises(HttpError) as refused:
        to_request(body(**fields))
    assert refused.value.param == param and refused.value.code


def _violations(request: common_pb2.InferenceRequest) -> list[str]:
    with pytest.raises(ServiceError) as refused:
        validate(request)
    return [field for field, _ in refused.value.violations]


def _request(*tools: common_pb2.Tool, **fields) -> common_pb2.InferenceRequest:
    return common_pb2.InferenceRequest(prompt="Hi", tools=tools, **fields)


def test_the_validation_rules_name_each_field():
    add = common_pb2.Tool(name="add", parameters=json.dumps(ADD))
    assert _violations(_request(common_pb2.Tool(name="bad name"))) == ["request.tools[0].name"]
    assert _violations(_request(add, add)) == ["request.tools[1].name"]
    assert _violations(_request(common_pb2.Tool(name="f", parameters='{"type": "array"}'))) == [
        "request.tools[0].parameters"
    ]
    assert _violations(_request(common_pb2.Tool(name="f", parameters="{not json"))) == [
        "request.tools[0].parameters"
    ]
    assert _violations(_request(add, tool_choice=common_pb2.ToolChoice(function="sub"))) == [
        "request.tool_choice.function"
    ]
    assert _violations(
        _request(tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED))
    ) == ["request.tool_choice"]
    assert _violations(_request(add, json_schema='{"type": "object"}')) == ["request.response_format"]
    assert _violations(_request(add, raw=True)) == ["request.raw"]
    call = common_pb2.ToolCall(id="c", name="add", arguments="[1]")
    history = [common_pb2.ChatMessage(role="user", content="x", tool_calls=[call])]
    assert _violations(common_pb2.InferenceRequest(messages=history)) == [
        "request.messages[0].tool_calls",
        "request.messages[0].tool_calls[0].arguments",
    ]
    # A schema llguidance cannot enforce is refused at admission, not when the engine samples.
    unenforceable = json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "format": "no-such"}}}
    )
    assert _violations(_request(common_pb2.Tool(name="f", parameters=unenforceable))) == ["request.tools"]
    none = common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE)
    validate(_request(add, tool_choice=none, json_schema='{"type": "object"}'))  # no call: a format is fine


def test_violations_are_named_as_openai_nests_them():
    openai_body = body(tools=[TOOL])
    assert param_of("request.tools[2].name", openai_body) == "tools[2].function.name"
    assert param_of("request.tools[0].parameters", openai_body) == "tools[0].function.parameters"
    assert param_of("request.tool_choice.function", openai_body) == "tool_choice.function.name"
    assert param_of("request.tools", openai_body) == "tools"
    call = "messages[1].tool_calls[0]"
    assert param_of(f"request.{call}.arguments", openai_body) == f"{call}.function.arguments"
    assert param_of(f"request.{call}.name", openai_body) == f"{call}.function.name"
    assert param_of(f"request.{call}.id", openai_body) == f"{call}.id"


def test_a_choice_of_calls_has_null_content():
    choice = common_pb2.Choice(
        text="<tool_call>…", tool_calls=[common_pb2.ToolCall(id="call_a", name="f", arguments="{}")]
    )
    assert chat_message(choice) == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert chat_message(common_pb2.Choice(text="Hi")) == {"role": "assistant", "content": "Hi"}


def test_the_deprecated_functions_map_onto_tools_with_one_call_at_most():
    function = TOOL["function"]
    request = to_request(body(functions=[function], function_call={"name": "add"}))
    assert [t.name for t in request.tools] == ["add"] and json.loads(request.tools[0].parameters) == ADD
    assert request.tool_choice.function == "add" and request.parallel_tool_calls is False
    auto = to_request(body(functions=[function], function_call="auto"))
    assert auto.tool_choice.mode == common_pb2.TOOL_CHOICE_MODE_AUTO
    legacy = body(functions=[function])
    assert param_of("request.tools[0].name", legacy) == "functions[0].name"
    assert param_of("request.tool_choice.function", legacy) == "function_call.name"


def test_a_deprecated_history_becomes_calls_and_results():
    messages = [
        {"role": "user", "content": "Add 1"},
        {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": '{"a": 1}'}},
        {"role": "function", "name": "add", "content": "1"},
    ]
    request = to_request(ChatCompletionRequest(model="m", messages=messages, functions=[TOOL["function"]]))
    _, assistant, result = request.messages
    [call] = assistant.tool_calls
    assert (call.name, call.arguments, assistant.content) == ("add", '{"a": 1}', "")
    assert (result.role, result.tool_call_id, result.content) == ("tool", call.id, "1")
    bad = [messages[0], {"role": "assistant", "function_call": {"name": "add", "arguments": {}}}]
    with pytest.raises(HttpError) as refused:
        to_request(ChatCompletionRequest(model="m", messages=bad))
    assert refused.value.param == "messages[1].function_call.arguments"


def test_a_deprecated_call_is_a_function_call_named_then_in_pieces():
    call = common_pb2.ToolCall(id="call_a", name="f", arguments=json.dumps({"text": "x" * 40}))
    choice = common_pb2.Choice(text="<tool_call>…", tool_calls=[call])
    assert chat_message(choice, legacy=True) == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "f", "arguments": call.arguments},
    }
    pieces = [
        common_pb2.ToolCallDelta(index=0, id="call_a", name="f"),
        common_pb2.ToolCallDelta(index=0, arguments=call.arguments[:9]),
        common_pb2.ToolCallDelta(index=0, arguments=call.arguments[9:]),
    ]
    first, *rest = [legacy_call_delta(piece) for piece in pieces]
    assert first == {"function_call": {"name": "f", "arguments": ""}}
    assert "".join(d["function_call"]["arguments"] for d in rest) == call.arguments


@pytest.mark.parametrize("legacy", [False, True])
def test_a_streamed_call_comes_as_tool_calls_or_function_call_deltas(legacy):
    admission = FakeAdmission()
    call = common_pb2.ToolCall(id="call_a", type="function", name="add", arguments='{"a": 1}')
    admission.result = common_pb2.InferenceResult(
        job_id="j1",
        status=common_pb2.JOB_STATUS_COMPLETED,
        choices=[
            common_pb2.Choice(
                text="",  # the engine sends a call's pieces, never its markup (FakeAdmission.stream)
                finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS,
                tool_calls=[call],
            )
        ],
    )
    tools = {"functions": [TOOL["function"]]} if legacy else {"tools": [TOOL]}
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True, **tools}
    answer = TestClient(create_app(admission, FakeCapacity(), FakeModels())).post(
        "/v1/chat/completions", json=body
    )
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas)  # the call's text is never content
    key = "function_call" if legacy else "tool_calls"
    parts = [d[key] for d in deltas if key in d]
    if legacy:
        assert parts[0]["name"] == "add" and "".join(p["arguments"] for p in parts) == call.arguments
    else:
        assert (
            parts[0][0]["id"] == "call_a"
            and "".join(p[0]["function"]["arguments"] for p in parts) == call.arguments
        )
    assert chunks[-1]["choices"][0]["finish_reason"] == ("function_call" if legacy else "tool_calls")
