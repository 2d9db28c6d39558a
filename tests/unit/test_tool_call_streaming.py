"""Tool calls split out of an output as it is generated (libs/tools/streaming.py, docs/api.md
#tool-calling): for every way the text can arrive in pieces (split at every character boundary,
and character by character), the call deltas name each call once and first, their arguments put
together are exactly the final call's arguments, and nothing of the markup is content; text is
content as it comes. Then the two owners around it: reception's choices (deltas carried, ids kept
across a resumed run) and the OpenAI chunks made of the deltas."""

from __future__ import annotations

import itertools
import json

import pytest

from libs.gen.expert.v1 import common_pb2, engine_pb2
from libs.tools.families import FALLBACK, ToolFamily
from libs.tools.parsing import parse_calls
from libs.tools.streaming import CallDelta, CallStream
from services.reception.dispatch.choices import Choices
from services.reception.http.openai_response import Chunks
from services.reception.http.openai_schema import ChatCompletionRequest

HERMES = ToolFamily("hermes", native=True)
LLAMA3 = ToolFamily("llama3_json", native=True)

HERMES_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, {"a": null}]}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA3_CALLS = (
    '{"name": "add", "parameters": {"a": 1, "b": -2.5e3}}; {"name": "neg", "parameters": {"x": true}}'
)
# Arguments before the name: the name is announced first all the same.
NAME_LAST = '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'


def run(family: ToolFamily, pieces: list[str], cut: bool = False):
    """The content, the deltas and the finished calls of an output that arrives in `pieces`."""
    counter = itertools.count()
    stream = CallStream(family, new_id=lambda: f"call_{next(counter)}")
    content, deltas = "", []
    for piece in pieces:
        more, new = stream.feed(piece)
        content, deltas = content + more, deltas + new
    more, new, calls = stream.finish(cut)
    return content + more, deltas + new, calls


def splits(text: str):
    yield [text]
    yield list(text)  # character by character
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def assert_deltas_make_the_calls(deltas: list[CallDelta], calls) -> None:
    streamed: dict[int, dict] = {}
    for delta in deltas:
        if delta.id:  # the first delta of a call names it, and comes before its arguments
            assert delta.index not in streamed and not delta.arguments
            streamed[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
        else:
            streamed[delta.index]["arguments"] += delta.arguments
    assert list(streamed) == list(range(len(calls)))
    assert [(s["id"], s["name"], s["arguments"]) for s in streamed.values()] == [
        (c.id, c.name, c.arguments) for c in calls
    ]


@pytest.mark.parametrize(
    ("family", "text", "names"),
    [
        (HERMES, HERMES_CALLS, ["get_weather", "get_time"]),
        (FALLBACK, HERMES_CALLS, ["get_weather", "get_time"]),
        (LLAMA3, LLAMA3_CALLS, ["add", "neg"]),
        (HERMES, NAME_LAST, ["get_time"]),
    ],
)
def test_calls_split_anywhere_stream_as_deltas_that_add_up_to_the_calls(family, text, names):
    parsed = parse_calls(family, text)
    for pieces in splits(text):
        content, deltas, calls = run(family, pieces)
        assert content == "", pieces
        assert [c.name for c in calls] == names
        assert_deltas_make_the_calls(deltas, calls)
        # The arguments are the model's own JSON text: the same values the whole-output parser reads.
        assert [json.loads(c.arguments) for c in calls] == [json.loads(p.arguments) for p in parsed]


def test_arguments_go_out_as_they_are_written_not_at_the_end():
    _, deltas, _ = run(HERMES, list(HERMES_CALLS))
    pieces = [d.arguments for d in deltas if d.index == 0 and d.arguments]
    assert len(pieces) > 10 and pieces[0] == "{"


def test_text_is_content_as_it_comes_even_where_it_mentions_a_call():
    text = 'Hello! <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> is how I would call.'
    for pieces in splits(text):
        stream = CallStream(HERMES)
        first, _ = stream.feed(pieces[0])
        assert first == pieces[0]  # nothing held: text cannot start the way a call starts
        content, deltas, calls = run(HERMES, pieces)
        assert (content, deltas, calls) == (text, [], [])


def test_a_cut_output_keeps_its_complete_calls_and_leaks_no_markup():
    unfinished = HERMES_CALLS + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    content, deltas, calls = run(HERMES, list(unfinished), cut=True)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    # The unfinished third call was streamed as far as it went, then dropped, as vLLM does.
    assert {d.index for d in deltas} == {0, 1, 2}
    for cut_first in ('<tool_call>\n{"name": "get_weather", "argu', "<tool_"):
        assert run(HERMES, list(cut_first), cut=True)[::2] == ("", [])


def test_a_resumed_run_reads_what_was_sent_without_sending_it_again():
    sent, rest = HERMES_CALLS[:60], HERMES_CALLS[60:]  # the cut is inside the first arguments
    stream = CallStream(HERMES)
    stream.feed(sent)  # the earlier run's text
    content, deltas = stream.feed(rest)
    _, last, calls = stream.finish(cut=False)
    assert content == "" and not any(d.index == 0 and d.id for d in deltas + last)
    whole = "".join(d.arguments for d in deltas + last if d.index == 0)
    assert calls[0].arguments.endswith(whole) and len(whole) < len(calls[0].arguments)


def test_reception_carries_the_deltas_and_keeps_the_ids_its_readers_have():
    choices = Choices()
    header = common_pb2.ToolCallDelta(index=0, id="call_first", name="add")
    delta = choices.add(engine_pb2.GenerateResponse(index=0, token_ids=[5], tool_call_deltas=[header]))
    assert delta is not None and list(delta.tool_calls) == [header] and delta.text == ""
    # A resumed run names the call anew in its result: the id already streamed stays.
    final = common_pb2.ToolCall(id="call_second", type="function", name="add", arguments="{}")
    choices.add(
        engine_pb2.GenerateResponse(
            index=0, token_ids=[6], tool_calls=[final], finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS
        )
    )
    assert [c.id for c in choices.outcome().choices[0].tool_calls] == ["call_first"]


def test_openai_chunks_name_a_call_then_send_its_argument_pieces():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    chunks = Chunks("job", body, chat=True, include_usage=False, n=1, calls=True)
    pieces = [
        common_pb2.ToolCallDelta(index=0, id="call_a", name="add"),
        common_pb2.ToolCallDelta(index=0, arguments='{"a": '),
    ]
    lines = chunks.delta(common_pb2.ChoiceDelta(index=0, tool_calls=pieces))
    assert [json.loads(line.removeprefix("data: "))["choices"][0]["delta"] for line in lines] == [
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "add", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
    ]
    # A call's tokens carry logprobs but no text: nothing is sent as content for them.
    token = common_pb2.TokenLogprob(token="<tool_call>", logprob=-0.1)
    assert chunks.delta(common_pb2.ChoiceDelta(index=0, logprobs=[token])) == []
