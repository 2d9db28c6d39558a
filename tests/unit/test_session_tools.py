"""Tools in a session's turns (docs/api.md#tools-in-a-session), without a stack: the SDK sends a
turn's tools and reads its calls, the tools reach the turn's job, and the turn lists them to the
model only when the session has not seen them."""

from __future__ import annotations

from expert_system._proto.expert.v1 import common_pb2 as sdk_common
from expert_system._proto.expert.v1 import session_pb2 as sdk_session
from expert_system.session import generate_request, turn_end_from_proto
from libs.gen.expert.v1 import common_pb2, session_pb2, session_state_pb2
from services.reception.dispatch.turns import SessionTurn
from services.reception.sessions import turn_request

ADD = common_pb2.Tool(name="add", parameters='{"type": "object"}')
SUB = common_pb2.Tool(name="sub")
USER = common_pb2.ChatMessage(role="user", content="2 plus 3?")


def _plan(*tools: common_pb2.Tool) -> common_pb2.ExpertPlan:
    return common_pb2.ExpertPlan(generation_params=common_pb2.GenerationParams(tools=tools))


def _shown(record: session_state_pb2.SessionRecord, plan: common_pb2.ExpertPlan):
    return SessionTurn(store=None, record=record, job_id="j")._tools_to_show(plan)


def test_a_turns_tools_reach_its_request():
    turn = session_pb2.GenerateStreamRequest(
        tools=[ADD], tool_choice=common_pb2.ToolChoice(function="add"), parallel_tool_calls=False
    )
    request = turn_request(session_state_pb2.SessionRecord(turn_input=[USER]), turn)
    assert list(request.tools) == [ADD] and request.tool_choice.function == "add"
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    plain = turn_request(
        session_state_pb2.SessionRecord(turn_input=[USER]), session_pb2.GenerateStreamRequest()
    )
    assert not plain.tools and not plain.HasField("tool_choice") and not plain.HasField("parallel_tool_calls")


def test_tools_are_listed_only_when_the_session_has_not_seen_them():
    fresh = session_state_pb2.SessionRecord(turn_input=[USER])
    assert _shown(fresh, _plan(ADD)) == [ADD]
    seen = session_state_pb2.SessionRecord(turn_input=[USER], tools_shown=[ADD])
    assert _shown(seen, _plan(ADD)) is None  # the same tools: nothing anew
    assert _shown(seen, _plan(ADD, SUB)) == [ADD, SUB]  # changed: listed again
    assert _shown(seen, _plan()) is None  # no tools: the last listing stays
    going_on = session_state_pb2.SessionRecord(turns=1)  # a cut reply goes on: no message to precede
    assert _shown(going_on, _plan(SUB)) is None


def test_the_sdk_sends_a_turns_tools_and_reads_its_calls():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    request = generate_request("s", {"tools": [tool], "tool_choice": "add", "parallel_tool_calls": False})
    assert [t.name for t in request.tools] == ["add"] and request.tool_choice.function == "add"
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    plain = generate_request("s", {})
    assert not plain.tools and not plain.HasField("tool_choice") and not plain.HasField("parallel_tool_calls")
    call = sdk_common.ToolCall(id="call_a", type="function", name="add", arguments="{}")
    end = turn_end_from_proto(
        sdk_session.TurnEnd(finish_reason=sdk_common.FINISH_REASON_TOOL_CALLS, tool_calls=[call])
    )
    assert end.finish_reason == "tool_calls" and [(c.id, c.name) for c in end.tool_calls] == [
        ("call_a", "add")
    ]
