"""Samples as token ids and labels, rendered exactly as the engine renders a request at serving time.

At serving time the router turns a prompt into a one-turn conversation and the engine renders it with
the checkpoint's chat template (`add_generation_prompt=True`) and encodes that text without adding
special tokens; a checkpoint without a chat template gets the turns' contents joined by blank lines,
encoded with its special tokens. The model then writes the answer token by token and stops at an end
token. So a sample is encoded the same way: the context up to each assistant turn as the engine would
encode it (no loss), then the assistant's tokens up to and including the end token the template writes
(the loss), so the expert learns to stop where serving stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.engine.tokenizer import Tokenizer
from libs.training.data import DataError, Sample

IGNORE = -100  # the label of a token that carries no loss (PyTorch's cross-entropy ignore_index)


@dataclass(frozen=True)
class Encoded:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]  # the token itself where it is learned, IGNORE elsewhere
    source: str

    @property
    def num_learned(self) -> int:
        return sum(label != IGNORE for label in self.labels)


class SampleEncoder:
    """Encodes samples for one checkpoint's tokenizer; `max_length` bounds a sample's tokens (soft
    prompt tokens included, `reserved`)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, reserved: int = 0) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.reserved = reserved
        self.stop_ids = tokenizer.eos_token_ids

    def encode(self, sample: Sample) -> Encoded:
        if self.tokenizer.chat_template is None:
            ids, labels = self._without_template(sample)
        else:
            ids, labels = self._with_template(sample)
        length = len(ids) + self.reserved
        if length > self.max_length:
            extra = f" ({self.reserved} of them the soft prompt's)" if self.reserved else ""
            raise DataError(
                f"{sample.source}: {length} tokens{extra}, longer than the {self.max_length} the model takes"
            )
        return Encoded(tuple(ids), tuple(labels), sample.source)

    def _with_template(self, sample: Sample) -> tuple[list[int], list[int]]:
        messages = list(sample.messages)
        ids: list[int] = []
        labels: list[int] = []
        rendered = ""  # the text encoded so far
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            context = self._render(messages[:i], True, sample)
            turn = self._render(messages[: i + 1], False, sample)
            if not (context.startswith(rendered) and turn.startswith(context)):
                raise DataError(
                    f"{sample.source}: the chat template does not render this conversation turn by turn "
                    "(an earlier turn changes when a later one is added), so the turns cannot be told apart"
                )
            context_ids = self.tokenizer.encode(context[len(rendered) :], add_special_tokens=False)
            answer_ids = self.tokenizer.encode(turn[len(context) :], add_special_tokens=False)
            answer_labels = self._answer_labels(answer_ids)  # may append an end token to answer_ids
            ids += context_ids + answer_ids
            labels += [IGNORE] * len(context_ids) + answer_labels
            rendered = turn
        return ids, labels

    def _without_template(self, sample: Sample) -> tuple[list[int], list[int]]:
        # The engine joins a conversation's contents when the checkpoint has no template; only the
        # final answer follows its context the way a generated one would.
        *history, answer = sample.messages
        context_ids = self.tokenizer.encode("\n\n".join(m["content"] for m in history))
        answer_ids = self.tokenizer.encode(answer["content"], add_special_tokens=False)
        if self.tokenizer.eos_token_id is not None:
            answer_ids.append(self.tokenizer.eos_token_id)
        return context_ids + answer_ids, [IGNORE] * len(context_ids) + answer_ids

    def _answer_labels(self, answer_ids: list[int]) -> list[int]:
        """The answer's tokens are learned up to and including the first end token; what the template
        writes after it (a newline) is never generated, so it carries no loss. A template that writes
        no end token after an answer gets the eos token appended (`answer_ids` grows), so the expert
        still learns to stop."""
        for end, token in enumerate(answer_ids):
            if token in self.stop_ids:
                return answer_ids[: end + 1] + [IGNORE] * (len(answer_ids) - end - 1)
        if self.tokenizer.eos_token_id is not None:
            answer_ids.append(self.tokenizer.eos_token_id)
        return list(answer_ids)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool, sample: Sample) -> str:
        from libs.engine.tokenizer.chat_template import ChatTemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        except ChatTemplateError as exc:
            raise DataError(f"{sample.source}: the chat template refused the conversation: {exc}") from None
