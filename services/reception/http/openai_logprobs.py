"""Token logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and the legacy completions' parallel lists (`tokens`, `token_logprobs`,
`top_logprobs` as {token: logprob}, `text_offset`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from libs.gen.expert.v1 import common_pb2


def chat_logprobs(tokens: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": list(t.token_bytes),
                "top_logprobs": [
                    {"token": top.token, "logprob": top.logprob, "bytes": list(top.token_bytes)}
                    for top in t.top_logprobs
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: Sequence[common_pb2.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`offset`: where the first token starts in the choice's text (the text streamed before it)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{top.token: top.logprob for top in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
    }
