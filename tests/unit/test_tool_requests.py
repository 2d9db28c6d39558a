"""Tool calling at reception (docs/api.md#tool-calling): OpenAI's shapes parsed into the request
(a bad shape is a 400 naming its part), the validation rules (each violation naming its field),
and a result's calls in OpenAI's message (their streaming: tests/unit/test_tool_call_streaming.py)."""

from __future__ import annotations

import json

import pytest

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from services.reception.admission.validation import validate
from services.reception.http.errors import HttpError, param_of
from services.reception.http.openai_request import to_request
from services.reception.http.openai_response import chat_message
from services.reception.http.openai_schema import ChatCompletionRequest

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
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "none"}, "function_call"),
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
