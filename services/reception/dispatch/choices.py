"""A job's choices as its engine stream builds them: each choice's text, tokens, logprobs and end,
gathered from the engine's per-choice messages, and the outcome they make (choice 0 is the
outcome's own text and finish_reason, so a client that knows one choice keeps working)."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.gen.expert.v1 import common_pb2, engine_pb2


@dataclass
class _Choice:
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)
    # The ids its streamed calls were announced with, by call index: a resumed run names the calls
    # it reads again anew, and the result keeps the ids the job's readers already have.
    call_ids: dict[int, str] = field(default_factory=dict)


class Choices:
    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}

    def clear(self) -> None:
        """Forget everything (the job starts over on another engine)."""
        self._choices.clear()

    def add(self, response: engine_pb2.GenerateResponse) -> common_pb2.ChoiceDelta | None:
        """Record an engine message; the delta to announce (None: no new text or logprobs)."""
        choice = self._choices.setdefault(response.index, _Choice())
        choice.tokens += len(response.token_ids)
        choice.token_ids.extend(response.token_ids)
        choice.logprobs.extend(response.logprobs)
        if response.finish_reason:
            choice.finish_reason = response.finish_reason
        for call in response.tool_call_deltas:
            if call.id:
                choice.call_ids.setdefault(call.index, call.id)
        for k, call in enumerate(response.tool_calls):  # a choice's calls come in one message
            call.id = choice.call_ids.get(k, call.id)
        choice.tool_calls.extend(response.tool_calls)
        if not (response.text or response.logprobs or response.tool_call_deltas):
            return None
        if response.text:
            choice.pieces.append(response.text)
        return common_pb2.ChoiceDelta(
            index=response.index,
            text=response.text,
            logprobs=response.logprobs,
            tool_calls=response.tool_call_deltas,
        )

    def resumable(self, n: int) -> list[int] | None:
        """The output tokens a new run of the job goes on from (GenerateRequest.resume_token_ids):
        none when nothing was made yet; the one choice's tokens when it has not ended; None when
        the run must start over from the prompt (several choices, or one that ended)."""
        if not any(c.tokens or c.pieces or c.logprobs for c in self._choices.values()):
            return []
        only = self._choices.get(0)
        if n > 1 or len(self._choices) > 1 or only is None or only.finish_reason:
            return None
        return list(only.token_ids)

    def token_ids(self, index: int) -> list[int]:
        """The tokens choice `index` generated so far."""
        choice = self._choices.get(index)
        return list(choice.token_ids) if choice else []

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self._choices.values())

    def outcome(self, finish_reason: int = 0) -> common_pb2.GenerationOutcome:
        """The outcome so far; `finish_reason` stands for the choices that did not finish (a partial
        outcome has none)."""
        choices = [
            common_pb2.Choice(
                index=index,
                text="".join(c.pieces),
                finish_reason=c.finish_reason or finish_reason,
                tokens_generated=c.tokens,
                logprobs=c.logprobs,
                tool_calls=c.tool_calls,
            )
            for index, c in sorted(self._choices.items())
        ]
        first = choices[0] if choices else common_pb2.Choice()
        return common_pb2.GenerationOutcome(
            text=first.text,
            completion_tokens=self.completion_tokens,
            finish_reason=first.finish_reason,
            choices=choices,
        )
