"""A job's result in OpenAI's shapes: the chat or completions response, the chunks of a streamed one
(server-sent events), and the error of a job that failed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from libs.gen.expert.v1 import common_pb2
from libs.job_results import failure_code
from services.reception.http.errors import HTTP_STATUS, HttpError, param_of
from services.reception.http.openai_logprobs import chat_logprobs, completion_logprobs

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TIMEOUT: "length",  # cut short by timeout_ms: a limit, like max_tokens
    common_pb2.FINISH_REASON_ABORT: "abort",  # cancelled (CancelJob) while it ran
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def failure(result: common_pb2.InferenceResult, body) -> HttpError | None:
    """The error for a job that ended without an answer (a refusal was raised before); a later
    stage's refusal names the first field it found wrong (e.g. the engine's `n` above its
    max_num_seqs) as the client sent it."""
    if result.status != common_pb2.JOB_STATUS_FAILED:
        return None
    code = failure_code(result)
    status = HTTP_STATUS.get(code, 500) if code is not None else 500
    param = param_of(result.error_fields[0].field, body) if result.error_fields else None
    name = code.name.lower() if code is not None else "job_failed"
    return HttpError(status, result.error or "the job failed", param, code=name)


def usage(result: common_pb2.InferenceResult) -> dict[str, Any]:
    prompt = result.metrics.input_tokens
    completion = result.metrics.output_tokens or result.tokens_generated
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.metrics.cached_tokens},
    }


def finish_reason_name(reason: int) -> str:
    return _FINISH_REASONS.get(reason, "stop")


def result_choices(result: common_pb2.InferenceResult) -> list[common_pb2.Choice]:
    """The result's choices (a result recorded without them, e.g. swept at its deadline: its text)."""
    if result.choices:
        return list(result.choices)
    only = common_pb2.Choice(text=result.text, finish_reason=result.finish_reason)
    only.validation.CopyFrom(result.validation)
    return [only]


def extra(result: common_pb2.InferenceResult) -> dict[str, Any]:
    """What the Expert System adds to OpenAI's response: the job, the experts it applied and each
    choice's validation (response_format's schema is checked after generation, not enforced), and
    whether validation was skipped (postproc unreachable until the job's deadline)."""
    return {
        "job_id": result.job_id,
        "experts": list(result.experts_used),
        "validation_skipped": result.validation_skipped,
        "validation": [
            {
                "index": c.index,
                "valid": c.validation.valid,
                "validator": c.validation.validator,
                "error": c.validation.error,
            }
            for c in result_choices(result)
        ],
    }


def _kind(chat: bool, streamed: bool) -> tuple[str, str]:
    """The response's `object` and its id's prefix."""
    if chat:
        return ("chat.completion.chunk" if streamed else "chat.completion"), "chatcmpl-"
    return "text_completion", "cmpl-"


def response(result: common_pb2.InferenceResult, body, chat: bool, logprobs: bool) -> dict[str, Any]:
    """The answer to a non-streamed chat or completions request."""
    created = int(result.metrics.submitted_at.seconds) or int(time.time())
    choices = []
    for c in result_choices(result):
        choice: dict[str, Any] = {"index": c.index}
        if chat:
            choice["message"] = chat_message(c, legacy=_legacy(body))
            choice["logprobs"] = chat_logprobs(c.logprobs) if logprobs else None
        else:
            choice["text"] = c.text
            choice["logprobs"] = completion_logprobs(c.logprobs) if logprobs else None
        choice["finish_reason"] = _finish_reason(c, body)
        choices.append(choice)
    kind, prefix = _kind(chat, streamed=False)
    return {
        "id": prefix + result.job_id,
        "object": kind,
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": usage(result),
        "expert_system": extra(result),
    }


def _legacy(body) -> bool:
    """Whether the request used the deprecated functions form (its calls are `function_call`s)."""
    return bool(getattr(body, "legacy_functions", False))


def _finish_reason(choice: common_pb2.Choice, body) -> str:
    if choice.tool_calls and _legacy(body):
        return "function_call"
    return finish_reason_name(choice.finish_reason)


def chat_message(choice: common_pb2.Choice, legacy: bool = False) -> dict[str, Any]:
    """A chat choice's message: its text, or (content null) the tool calls it made (`legacy`: the
    deprecated form's one `function_call`)."""
    if not choice.tool_calls:
        return {"role": "assistant", "content": choice.text}
    if legacy:
        call = choice.tool_calls[0]  # the form allows one call: the request asked for no more
        return {"role": "assistant", "content": None, "function_call": _function(call)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call(call) for call in choice.tool_calls],
    }


def _function(call: common_pb2.ToolCall) -> dict[str, str]:
    return {"name": call.name, "arguments": call.arguments}


def tool_call(call: common_pb2.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": _function(call)}


def event(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Chunks:
    """The server-sent chunks of one streamed chat or completions answer (one choice per chunk,
    named by its index), for the job `job_id`; `n` choices."""

    def __init__(
        self,
        job_id: str,
        body,
        chat: bool,
        include_usage: bool,
        n: int,
        calls: bool = False,
        first_index: int = 0,
    ) -> None:
        """`first_index`: the index the job's first choice has in the answer (one prompt of several
        streamed together: completion_streams.py)."""
        self.body, self.chat, self.include_usage = body, chat, include_usage
        self.first_index = first_index
        # With tools the model may call, tokens without text are a call's (OpenAI gives no
        # logprobs for calls), so their logprobs are not sent as content.
        self.calls = calls
        self.created = int(time.time())
        self.kind, prefix = _kind(chat, streamed=True)
        self.id = prefix + job_id
        self.offsets = dict.fromkeys(range(n), 0)  # completions' text_offset: each choice's text so far

    def opening(self) -> Iterator[str]:
        """Chat's first chunk of each choice, which names the role (completions have none)."""
        if self.chat:
            for index in self.offsets:
                yield event(self._chunk(index, "", role=True))

    def delta(self, delta: common_pb2.ChoiceDelta) -> list[str]:
        """The events of a choice's new text (with its logprobs) and of its calls' new pieces (the
        engine split them: a call's markup never arrives as text)."""
        shown = delta.text or (delta.logprobs and not self.calls)
        events = [self._delta_event(delta)] if shown else []
        # One chunk per piece, as OpenAI sends them (a client may merge pieces by index per chunk).
        piece = legacy_call_delta if _legacy(self.body) else call_delta
        events += (event(self._calls_chunk(delta.index, piece(c))) for c in delta.tool_calls)
        return events

    def _delta_event(self, delta: common_pb2.ChoiceDelta) -> str:
        data = self._chunk(delta.index, delta.text, logprobs=list(delta.logprobs))
        advance = sum(len(t.token) for t in delta.logprobs)
        self.offsets[delta.index] = self.offsets.get(delta.index, 0) + advance
        return event(data)

    def ending(self, result: common_pb2.InferenceResult) -> Iterator[str]:
        """Each choice's finish chunk, the usage chunk if asked for, and `data: [DONE]`."""
        yield from self.finishes(result)
        yield from self.closing(usage(result))

    def closing(self, total_usage: dict[str, Any]) -> Iterator[str]:
        """The usage chunk if asked for, and `data: [DONE]`."""
        if self.include_usage:
            yield event(self._head() | {"choices": [], "usage": total_usage})
        yield "data: [DONE]\n\n"

    def finishes(self, result: common_pb2.InferenceResult) -> Iterator[str]:
        """Each choice's finish chunk."""
        for c in result_choices(result):
            finished = self._chunk(c.index, None if self.chat else "", _finish_reason(c, self.body))
            yield event({**finished, "expert_system": extra(result)})

    def _calls_chunk(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        data = self._head() | {
            "choices": [
                {"index": self.first_index + index, "delta": delta, "logprobs": None, "finish_reason": None}
            ]
        }
        if self.include_usage:
            data["usage"] = None
        return data

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.body.model}

    def _chunk(
        self,
        index: int,
        delta: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: list[common_pb2.TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            content: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                content["content"] = delta
            shown = chat_logprobs(logprobs) if logprobs else None
            choice = {"delta": content}
        else:
            shown = completion_logprobs(logprobs, self.offsets.get(index, 0)) if logprobs else None
            choice = {"text": delta or ""}
        choice = {
            "index": self.first_index + index,
            **choice,
            "logprobs": shown,
            "finish_reason": finish_reason,
        }
        data = self._head() | {"choices": [choice]}
        if self.include_usage:
            data["usage"] = None
        return data


def call_delta(delta: common_pb2.ToolCallDelta) -> dict[str, Any]:
    """A call's piece as OpenAI streams it (a `tool_calls` delta): the first names the call, the
    others carry arguments."""
    if delta.id:
        function = {"name": delta.name, "arguments": delta.arguments}
        named = {"index": delta.index, "id": delta.id, "type": "function", "function": function}
        return {"tool_calls": [named]}
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.arguments}}]}


def legacy_call_delta(delta: common_pb2.ToolCallDelta) -> dict[str, Any]:
    """The deprecated form's piece of its one call (a `function_call` delta): the first names the
    function, the others carry arguments."""
    if delta.id:
        return {"function_call": {"name": delta.name, "arguments": delta.arguments}}
    return {"function_call": {"arguments": delta.arguments}}
