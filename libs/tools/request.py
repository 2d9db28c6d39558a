"""A request's tool settings as the pipeline carries them: copied from the InferenceRequest into
the plan's GenerationParams (the router, and a session's later turns), and read back by the engine."""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2

NONE, AUTO, REQUIRED = (
    common_pb2.TOOL_CHOICE_MODE_NONE,
    common_pb2.TOOL_CHOICE_MODE_AUTO,
    common_pb2.TOOL_CHOICE_MODE_REQUIRED,
)


def copy_tools(request: common_pb2.InferenceRequest, params: common_pb2.GenerationParams) -> None:
    """Set `params`' tools, tool_choice (auto when unset) and parallel_tool_calls (true when unset)
    from the request's."""
    params.ClearField("tools")
    params.ClearField("tool_choice")
    params.parallel_tool_calls = False
    if not request.tools:
        return
    params.tools.extend(request.tools)
    if request.HasField("tool_choice") and request.tool_choice.WhichOneof("choice"):
        params.tool_choice.CopyFrom(request.tool_choice)
    else:
        params.tool_choice.mode = AUTO
    params.parallel_tool_calls = (
        request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    )


def calls_enabled(params: common_pb2.GenerationParams) -> bool:
    """Whether the model may call a tool (tools given, and tool_choice not none)."""
    return bool(params.tools) and not (
        params.tool_choice.WhichOneof("choice") == "mode" and params.tool_choice.mode == NONE
    )


def callable_tools(params: common_pb2.GenerationParams) -> list[common_pb2.Tool]:
    """The tools a call may name: the named function alone, or every tool."""
    if params.tool_choice.WhichOneof("choice") == "function":
        return [t for t in params.tools if t.name == params.tool_choice.function]
    return list(params.tools)


def allows_text(params: common_pb2.GenerationParams) -> bool:
    """Under auto the model may answer with text instead of calls."""
    choice = params.tool_choice
    return choice.WhichOneof("choice") == "mode" and choice.mode == AUTO
