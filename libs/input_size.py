"""An upper bound of a model input's token count, for the KV budget: the router sizes a plan's
prompt with it, and reception a session turn's messages. A byte-level BPE never needs more tokens
than bytes; a chat template adds at most TEMPLATE_OVERHEAD_BYTES around each message, and
TOOLS_OVERHEAD_BYTES (the instructions of the fallback rendering, libs/tools/rendering.py) around
a request's tools."""

from __future__ import annotations

from collections.abc import Sequence

from libs.gen.expert.v1 import common_pb2

TEMPLATE_OVERHEAD_BYTES = 64
TOOLS_OVERHEAD_BYTES = 512


def input_bytes(model_input: common_pb2.ModelInput, tools: Sequence[common_pb2.Tool] = ()) -> int:
    """The input's UTF-8 bytes plus what a chat template adds per message, and the tools shown
    with it (token ids: their count, the exact number of tokens)."""
    if model_input.HasField("token_ids"):
        return len(model_input.token_ids.ids)
    if model_input.HasField("text"):
        return len(model_input.text.encode())
    messages = model_input.conversation.messages
    total = sum(_message_bytes(m) + TEMPLATE_OVERHEAD_BYTES for m in messages) + TEMPLATE_OVERHEAD_BYTES
    if tools:
        total += TOOLS_OVERHEAD_BYTES + sum(
            len(t.name.encode())
            + len(t.description.encode())
            + len(t.parameters.encode())
            + TEMPLATE_OVERHEAD_BYTES
            for t in tools
        )
    return total


def _message_bytes(message: common_pb2.ChatMessage) -> int:
    calls = sum(
        len(c.name.encode()) + len(c.arguments.encode()) + TEMPLATE_OVERHEAD_BYTES for c in message.tool_calls
    )
    return len(message.content.encode()) + len(message.name.encode()) + calls
