"""The request bodies of OpenAI's chat and completions endpoints, as reception accepts them: unknown
fields are refused, the numbers are bounded to what an InferenceRequest holds, and a flag is a JSON
boolean (`"yes"` is refused, not read as true). Text UTF-8 cannot carry is refused before these
models see the body, in one walk of the whole body (text_guard.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from services.reception.http.ignored_fields import IgnoredFields

INT32 = 2**31 - 1
UINT64 = 2**64 - 1


class _Body(BaseModel):
    # An argument the API does not know is refused (as OpenAI does), never silently ignored.
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # a tool result: the call it answers
    tool_call_id: str | None = None
    # an assistant's calls, checked part by part in openai_tools.py (the errors name the part)
    tool_calls: list[Any] | None = None
    # the deprecated form of an assistant's one call ({"name", "arguments"}), answered by a
    # `function` message (its `name` the function's)
    function_call: Any = None


class StreamOptions(_Body):
    include_usage: StrictBool = False


class SamplingFields(IgnoredFields):
    """The fields chat and completions share: the ignored ones (ignored_fields.py), OpenAI's, then
    vLLM-style extras."""

    model: str
    max_tokens: int | None = Field(None, le=INT32)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=-INT32, le=INT32)
    # checked part by part in response_format.py (the errors name the part)
    response_format: dict[str, Any] | None = None
    # not supported yet: accepted only at the value that asks for nothing (refused otherwise)
    logit_bias: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM-style extras (extra_body in the openai client)
    top_k: int | None = Field(None, ge=-1, le=INT32)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    speculative: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    # not in the engine yet: accepted at the value that changes nothing (0), refused otherwise
    min_tokens: int | None = Field(None, ge=0, le=INT32)
    force_experts: list[str] | None = None
    exclude_experts: list[str] | None = None
    max_experts: int | None = Field(None, ge=-INT32, le=INT32)
    priority: int | None = Field(None, ge=-INT32, le=INT32)
    # OpenAI's best_of (completions; vLLM takes it on chat too) and vLLM's beam-search extras, on
    # both routes as vLLM has them (openai_request.py maps them, reception's validation checks them)
    best_of: int | None = Field(None, ge=-INT32, le=INT32)
    use_beam_search: StrictBool | None = None
    length_penalty: float | None = None
    early_stopping: StrictBool | str | None = None

    @property
    def base_model(self) -> str:
        """The base model `model` names (`<base>` or `<base>:<expert>`, as vLLM and SGLang name adapters)."""
        return self.model.split(":", 1)[0]

    @property
    def model_expert(self) -> str | None:
        """The expert `model` names after its colon, forced on the job (None: the base model alone)."""
        return self.model.split(":", 1)[1] if ":" in self.model else None

    def forced_experts(self) -> list[str]:
        """The experts to force: the one `model` names first, then `force_experts` (without it again)."""
        given = list(self.force_experts or [])
        expert = self.model_expert
        return given if expert is None else [expert, *(e for e in given if e != expert)]


class ChatCompletionRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, le=INT32)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=-INT32, le=INT32)
    # checked part by part in openai_tools.py (the errors name the part)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    # the deprecated form of tools and tool_choice (openai_tools.py maps it onto them)
    functions: list[Any] | None = None
    function_call: Any = None

    @property
    def legacy_functions(self) -> bool:
        """Whether the request uses the deprecated `functions` / `function_call` form (answered
        with a message's `function_call` and finish_reason `function_call`)."""
        return self.functions is not None or self.function_call is not None


class CompletionRequest(SamplingFields):
    # OpenAI's four forms: a string, strings, token ids, lists of token ids; a list is checked item
    # by item in openai_request.prompts_of, so that an error names the item (`prompt[1][0]`)
    prompt: str | list[Any]
    logprobs: int | None = Field(None, ge=-INT32, le=INT32)
    echo: StrictBool | None = None
    suffix: str | None = None


FIELD_NAMES = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
FIELD_NAMES |= set(Message.model_fields) | set(TextPart.model_fields) | set(StreamOptions.model_fields)
