"""An OpenAI chat or completions body as the InferenceRequest the pipeline runs, refusing (400, the
param named) what this API does not support yet rather than ignoring it. `n` and the logprobs map to
the request's own fields; `response_format` becomes its `response_format`, the format the engine
enforces (with the regex and grammar extensions: services/reception/http/response_format.py)."""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2
from libs.limits import SAMPLING_FIELDS
from services.reception.admission.beams import early_stopping_word
from services.reception.http.errors import HttpError, not_supported
from services.reception.http.openai_schema import (
    INT32,
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    SamplingFields,
)
from services.reception.http.openai_tools import add_tools, function_result_ids, message_tool_fields
from services.reception.http.response_format import parse_response_format


def _refuse_unsupported(body: SamplingFields) -> None:
    if body.logit_bias:
        raise not_supported("logit_bias", "logit_bias")
    _refuse_other_outputs(body)
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise not_supported("echo", "echo")
        if body.suffix:
            raise not_supported("suffix", "suffix")
    _refuse_unstreamable(body)
    if body.stream_options is not None and not body.stream:
        raise HttpError(
            400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value"
        )


def _refuse_unstreamable(body: SamplingFields) -> None:
    """OpenAI's rule: best_of > n picks its outputs at the end, so it cannot stream; nor can a beam
    search, whose beams change until it ends."""
    if not body.stream:
        return
    if body.best_of is not None and body.best_of > (body.n if body.n is not None else 1):
        raise HttpError(400, "best_of greater than n cannot be streamed", "best_of", "invalid_value")
    if body.use_beam_search:
        raise HttpError(400, "use_beam_search cannot be streamed", "use_beam_search", "invalid_value")


def _refuse_other_outputs(body: SamplingFields) -> None:
    """What asks for more than text from a model, or for vLLM's `min_tokens`, which the engine does
    not have yet (ignoring either would answer another question)."""
    if body.audio is not None:
        raise not_supported("audio", "audio output")
    if body.web_search_options is not None:
        raise not_supported("web_search_options", "web search")
    if body.min_tokens:
        raise not_supported("min_tokens", f"min_tokens={body.min_tokens}")


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
    results = function_result_ids(body.messages)  # deprecated function messages: their calls
    for i, message in enumerate(body.messages):
        chat_message = common_pb2.ChatMessage(role=_role(message.role), content=_text(message, i))
        message_tool_fields(message, chat_message, i)
        if i in results:
            chat_message.tool_call_id = results[i]
        request.messages.append(chat_message)
    add_tools(request, body)
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _prompt(request: common_pb2.InferenceRequest, body: CompletionRequest) -> int | None:
    """A completion's first prompt onto the request, raw (no chat template), as text or token ids;
    its token limit. The other prompts of a list are set on copies (completion_prompts.py)."""
    set_prompt(request, prompts_of(body)[0])
    request.raw = True
    return body.max_tokens


def set_prompt(request: common_pb2.InferenceRequest, prompt: str | list[int]) -> None:
    """One prompt of a completions body onto its request: text, or token ids."""
    request.ClearField("prompt_token_ids")
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt = ""
        request.prompt_token_ids.extend(prompt)


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions body, each a string or token ids (OpenAI's four forms:
    "text", ["text", ...], [1, 2], [[1, 2], ...]); anything else is refused naming the item."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token(t) for t in prompt):
        return [_token_ids(prompt, "prompt")]
    if not prompt:
        raise HttpError(400, "prompt: must not be an empty list", "prompt", "invalid_value")
    return [_one_prompt(item, f"prompt[{i}]") for i, item in enumerate(prompt)]


def _one_prompt(item: object, param: str) -> str | list[int]:
    if isinstance(item, str):
        return item
    if isinstance(item, list):
        return _token_ids(item, param)
    message = f"{param}: a prompt is a string or a list of token ids, got {type(item).__name__}"
    raise HttpError(400, message, param, "invalid_type")


def _token_ids(ids: list, param: str) -> list[int]:
    """A list of token ids, each an integer in [0, 2^31 - 1] (below the vocabulary's size: the
    engine checks that, naming the id); not empty."""
    if not ids:
        raise HttpError(400, f"{param}: must not be empty", param, "invalid_value")
    for i, token in enumerate(ids):
        if not _is_token(token) or not 0 <= token <= INT32:
            message = f"{param}[{i}]: a token id is an integer in [0, {INT32}], got {token!r}"
            raise HttpError(400, message, f"{param}[{i}]", "invalid_value")
    return list(ids)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling(request: common_pb2.InferenceRequest, body: ChatCompletionRequest | CompletionRequest) -> None:
    """The sampling fields, `n`, the logprobs, the output format and the stop strings."""
    extras = ("max_experts", "priority", "ignore_eos", "skip_special_tokens", "speculative")
    for name in (*SAMPLING_FIELDS, *extras):
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
    _beam_search(request, body)


def _beam_search(request: common_pb2.InferenceRequest, body: SamplingFields) -> None:
    """OpenAI's best_of and vLLM's beam-search extras, chat's as completions' (reception's
    validation checks them, and refuses by name what beams cannot combine with: tools, logprobs,
    formats, stop strings, sampling)."""
    for name in ("best_of", "use_beam_search", "length_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(request, name, value)
    if body.early_stopping is not None:
        request.early_stopping = early_stopping_word(body.early_stopping)


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The alternatives per token to return (None: no logprobs): chat's `logprobs: true` with
    `top_logprobs` alternatives, or completions' `logprobs` itself."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise HttpError(400, "top_logprobs requires logprobs: true", "top_logprobs", "invalid_value")
    return (body.top_logprobs or 0) if body.logprobs else None


def _role(role: str) -> str:
    """OpenAI's roles as ours: developer is its newer name for system; function the deprecated
    form of a tool result."""
    return {"developer": "system", "function": "tool"}.get(role, role)


def _text(message: Message, index: int) -> str:
    if (
        message.content is None
        and message.role == "assistant"
        and (message.tool_calls or message.function_call)
    ):
        return ""  # an assistant's turn that only calls tools
    if message.content is None:
        raise HttpError(
            400,
            "a message without content is not supported yet",
            f"messages[{index}].content",
            "unsupported_parameter",
        )
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)
