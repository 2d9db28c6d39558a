"""The tokens a session turn adds to a conversation the engine already holds as tokens.

A session keeps its conversation as the exact tokens the model saw and produced; re-rendering the
whole conversation each turn would re-tokenize the replies (not always into the tokens that were
sampled) and could not reuse the kept KV. So a turn appends only what the chat template writes
after the history: the end of the last reply (unless the model already wrote it, as its end
token), the new messages, and the generation prompt. Rendered this way, the history plus the turn
equals the template's rendering of the whole conversation for every template that renders
message by message (ChatML, Llama 3, Mistral, ...); a template that rewrites earlier turns is
refused rather than silently diverging.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from libs.engine.tokenizer.chat_template import ChatTemplateError
from libs.engine.tokenizer.tokenizer import Tokenizer

# Private-use characters stand in for a conversation's last exchange: no template treats them
# specially, so whatever surrounds them is the template's own markup.
_USER, _REPLY = "\ue000", "\ue001"


def encode_turn(
    tokenizer: Tokenizer, history: Sequence[int], messages: Sequence[Mapping[str, Any]]
) -> list[int]:
    """The tokens to append to a session's `history` (the tokens of its turns so far) for a turn
    adding `messages`: the whole rendered conversation for the first turn, nothing when no message
    is added (the last reply goes on where it stopped). Raises ChatTemplateError naming the field."""
    if not history:
        if not messages:
            raise ChatTemplateError("messages: the first turn of a session needs a message")
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    if not messages:
        return []
    exchange = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY}]
    closed = tokenizer.apply_chat_template(exchange, add_generation_prompt=False)
    extended = tokenizer.apply_chat_template([*exchange, *messages], add_generation_prompt=True)
    if closed.count(_REPLY) != 1 or not extended.startswith(closed):
        raise ChatTemplateError(
            "chat_template: this model's template does not render a conversation message by message, "
            "so a session cannot extend one"
        )
    closing = closed[closed.index(_REPLY) + len(_REPLY) :]
    if history[-1] in tokenizer.eos_token_ids:  # the reply ended with the template's end token
        end = tokenizer.decode([history[-1]], skip_special_tokens=False)
        if closing.startswith(end):
            closing = closing[len(end) :]
    return tokenizer.encode(closing + extended[len(closed) :], add_special_tokens=False)
