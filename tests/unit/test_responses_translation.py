"""The Responses API's translation on its own (services/reception/http/responses_*.py): input items
into OpenAI's chat-completions messages (assistant `tool_calls`, `tool` messages with
`tool_call_id`), flat function tools and tool_choice into chat's nested shape (checked by the chat
request model and its translation into the pipeline's request), chat field names back
into the Responses API's, and a chat stream's chunks (text and `tool_calls` deltas, in OpenAI's
chat-chunk shape) into the typed events, validated by the `openai` package's own event models."""

from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from services.reception.http.errors import HttpError
from services.reception.http.responses_events import ResponseEvents
from services.reception.http.responses_input import input_messages
from services.reception.http.responses_output import assistant_message, from_completion, response_shell
from services.reception.http.responses_request import chat_request, responses_param
from services.reception.http.responses_schema import ResponsesRequest

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)


def test_a_replayed_tool_turn_becomes_chat_tool_calls_and_tool_messages():
    messages = input_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris?"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
                "id": "fc_1",
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Lyon"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
            {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
        ]
    )

    def call(i: int, args: str) -> dict:
        return {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}

    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [call(1, '{"city":"Paris"}'), call(2, '{"city":"Lyon"}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call(3, "{}")]},
    ]


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([], "input"),
        ([{"role": "robot", "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "input[0].content[0].type"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ],
)
def test_an_input_item_we_cannot_carry_is_refused_by_its_part(value, param):
    with pytest.raises(HttpError) as raised:
        input_messages(value)
    assert raised.value.param == param and raised.value.status == 400 and raised.value.code


def test_flat_function_tools_and_a_named_choice_take_chat_s_nested_shape():
    fields = {key: value for key, value in WEATHER.items() if key != "type"}
    body = _body(
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False
    )
    chat, _ = chat_request(body, [])
    assert chat.tools == [{"type": "function", "function": fields}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False


def test_instructions_history_and_input_make_the_chat_with_its_limits():
    history = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    body = _body(
        instructions="Be brief.",
        max_output_tokens=7,
        top_p=0.5,
        user="u1",
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    chat, added = chat_request(body, history)
    assert [m.content for m in chat.messages] == ["Be brief.", "A", "B", "hi"]
    assert added == [{"role": "user", "content": "hi"}]
    assert chat.max_completion_tokens == 7 and chat.top_p == 0.5 and chat.user == "u1"
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }


@pytest.mark.parametrize(
    ("chat", "ours"),
    [
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("messages[3].content", "input"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format.type", "text.format.type"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("temperature", "temperature"),
        (None, None),
    ],
)
def test_chat_field_names_become_the_responses_api_s(chat, ours):
    assert responses_param(chat) == ours


def _chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = (
        []
        if delta is None and finish is None
        else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    return {"id": "chatcmpl-job1", "object": "chat.completion.chunk", "choices": choices, **extra}


def _events(chunks: list[dict]) -> tuple[list, dict]:
    translator = ResponseEvents(response_shell(_body(tools=[WEATHER]), "job1"), "job1")
    events = translator.opening()
    for chunk in chunks:
        events += translator.chunk(chunk)
    ending, response = translator.ending()
    return [EVENT.validate_python(e) for e in events + ending], response


def test_streamed_text_then_tool_calls_become_typed_events_in_order():
    usage = {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    events, response = _events(
        [
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "Checking"}),
            _chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                }
            ),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
            _chunk(
                {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "call_b",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ]
                }
            ),
            _chunk(finish="tool_calls", expert_system={"job_id": "job1"}),
            _chunk(usage=usage),
        ]
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1].response
    assert isinstance(done, Response) and done.status == "completed" and done.usage.total_tokens == 15
    message, first, second = done.output
    assert message.content[0].text == "Checking"
    assert (first.call_id, first.arguments) == ("call_a", '{"city":"Paris"}') and second.call_id == "call_b"
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    assert assistant_message(response) == {
        "role": "assistant",
        "content": "Checking",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        ],
    }


def test_a_stream_cut_at_max_output_tokens_is_incomplete():
    events, _ = _events(
        [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "ab"}), _chunk(finish="length")]
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


def test_a_completion_with_tool_calls_becomes_function_call_items():
    completion = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_x",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "expert_system": {"job_id": "job2"},
    }
    response = Response.model_validate(
        from_completion(response_shell(_body(tools=[WEATHER]), "job2"), completion)
    )
    (call,) = response.output
    assert call.type == "function_call" and call.call_id == "call_x" and call.name == "get_weather"
    assert response.id == "resp_job2" and response.status == "completed" and response.output_text == ""
    assert response.tools[0].name == "get_weather"


def test_a_replayed_tool_turn_is_a_valid_chat_request_with_its_calls_and_result():
    from services.reception.http.openai_request import to_request

    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    chat, _ = chat_request(_body(input=items, tools=[WEATHER], tool_choice="none"), [])
    request = to_request(chat)  # the chat path's own translation into the pipeline's request
    user, assistant, tool = request.messages
    assert user.role == "user"
    assert (assistant.role, assistant.tool_calls[0].id, assistant.tool_calls[0].name) == (
        "assistant",
        "call_1",
        "get_weather",
    )
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny")
    assert [t.name for t in request.tools] == ["get_weather"]
