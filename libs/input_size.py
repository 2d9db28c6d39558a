"""An upper bound of a model input's token count, for the KV budget: the router sizes a plan's
prompt with it, and reception a session turn's messages. A byte-level BPE never needs more tokens
than bytes; a chat template adds at most TEMPLATE_OVERHEAD_BYTES around each message."""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2

TEMPLATE_OVERHEAD_BYTES = 64


def input_bytes(model_input: common_pb2.ModelInput) -> int:
    """The input's UTF-8 bytes plus what a chat template adds per message (token ids: their count,
    the exact number of tokens)."""
    if model_input.HasField("token_ids"):
        return len(model_input.token_ids.ids)
    if model_input.HasField("text"):
        return len(model_input.text.encode())
    messages = model_input.conversation.messages
    return sum(len(m.content.encode()) + TEMPLATE_OVERHEAD_BYTES for m in messages) + TEMPLATE_OVERHEAD_BYTES
