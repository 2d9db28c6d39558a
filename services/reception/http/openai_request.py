"""An OpenAI chat or completions body as the InferenceRequest the pipeline runs, refusing (400, the
param named) what this API does not support yet rather than ignoring it. `n` and the logprobs map to
the request's own fields; `response_format` becomes its `response_format`, the format the engine
enforces (with the regex and grammar extensions: services/reception/http/response_format.py)."""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2
from libs.limits import SAMPLING_FIELDS
from services.reception.http.errors import HttpError, not_supported
from services.reception.http.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    SamplingFields,
)
from services.reception.http.openai_tools import add_tools, message_tool_fields
from services.reception.http.response_format import parse_response_format


def _refuse_unsupported(body: SamplingFields) -> None:
    if body.logit_bias:
        raise not_supported("logit_bias", "logit_bias")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise not_supported("echo", "echo")
        if body.suffix:
            raise not_supported("suffix", "suffix")
        if body.best_of not in (None, 1):
            raise not_supported("best_of", f"best_of={body.best_of}")
    if body.stream_options is not None and not body.stream:
        raise HttpError(400, "stream_options is only allowed with stream: true", "stream_options")


def to_request(body: ChatCompletionRequest | CompletionRequest) -> common_pb2.InferenceRequest:
    """The InferenceRequest for an OpenAI request (refusing what this API does not support yet)."""
    _refuse_unsupported(body)
    # `<base>:<expert>`: the base model serves it, with the expert forced (see forced_experts).
    request = common_pb2.InferenceRequest(model=body.base_model)
    max_tokens = (
        _chat_input(request, body) if isinstance(body, ChatCompletionRequest) else _prompt(request, body)
    )
    if max_tokens is not None:
        request.max_tokens = max_tokens
    _sampling(request, body)
    request.force_experts.extend(body.forced_experts())  # `<base>:<expert>`'s expert first
    request.exclude_experts.extend(body.exclude_experts or [])
    if body.user is not None:
        request.user_id = body.user
    return request


def _chat_input(request: common_pb2.InferenceRequest, body: ChatCompletionRequest) -> int | None:
    """A chat's messages onto the request; its token limit (max_completion_tokens first)."""
    for i, message in enumerate(body.messages):
        chat_message = common_pb2.ChatMessage(role=_role(message.role), content=_text(message, i))
        message_tool_fields(message, chat_message, i)
        request.messages.append(chat_message)
    add_tools(request, body)
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _prompt(request: common_pb2.InferenceRequest, body: CompletionRequest) -> int | None:
    """A completion's one prompt onto the request, raw (no chat template); its token limit."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise not_supported("prompt", "a list of several prompts (batched completions)")
    request.prompt = prompts[0]
    request.raw = True
    return body.max_tokens


def _sampling(request: common_pb2.InferenceRequest, body: ChatCompletionRequest | CompletionRequest) -> None:
    """The sampling fields, `n`, the logprobs, the output format and the stop strings."""
    for name in (*SAMPLING_FIELDS, "max_experts", "priority"):
        value = getattr(body, name)
        if value is not None:
            setattr(request, name, value)
    if body.n is not None:
        request.n = body.n
    logprobs = _logprobs(body)
    if logprobs is not None:
        request.logprobs = logprobs
    if body.response_format is not None:
        response_format = parse_response_format(body.response_format, openai=True)
        if response_format is not None:
            request.response_format.CopyFrom(response_format)
    if body.top_k == -1:  # vLLM's "off"
        request.top_k = 0
    if body.stop is not None:
        request.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The alternatives per token to return (None: no logprobs): chat's `logprobs: true` with
    `top_logprobs` alternatives, or completions' `logprobs` itself."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise HttpError(400, "top_logprobs requires logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # OpenAI's newer name for the system role


def _text(message: Message, index: int) -> str:
    if message.content is None and message.role == "assistant" and message.tool_calls:
        return ""  # an assistant's turn that only calls tools
    if message.content is None:
        raise HttpError(400, "a message without content is not supported yet", f"messages[{index}].content")
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)
