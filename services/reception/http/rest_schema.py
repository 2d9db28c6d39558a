"""The request body of the Expert System's own REST API (`/v1/infer`, `/v1/jobs`): the fields of an
InferenceRequest under their proto names. Unknown fields are refused, the integers are bounded to
what the proto's fields hold, and a flag is a JSON boolean; text UTF-8 cannot carry is refused
before, in one walk of the whole body (text_guard.py); every other bound is reception's
validation. `response_format` is the one field in another shape: OpenAI's, as the SDK and the
OpenAI endpoints take it. A JSON schema (a tool's parameters, a call's arguments) may
be an object or its JSON text, and a tool_choice a mode's name alone."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallBody(_Body):
    """A call in an assistant message: ToolCall's fields, the arguments an object or its JSON text."""

    id: str = ""
    type: str = "function"
    name: str
    arguments: dict[str, Any] | str = ""


class ChatMessageBody(_Body):
    role: str
    # required, but on an assistant message with tool_calls (rest.py checks it)
    content: str | None = None
    name: str = ""
    tool_call_id: str = ""
    tool_calls: list[ToolCallBody] = []


class ToolBody(_Body):
    """A Tool: its parameter schema an object or its JSON text."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | str = ""
    strict: StrictBool = False


class ToolChoiceBody(_Body):
    """A ToolChoice: a `mode` or the `function` to call (exactly one: reception's validation)."""

    mode: Literal["none", "auto", "required"] | None = None
    function: str | None = None


class JobBody(_Body):
    """An InferenceRequest as JSON (docs/api.md#inferencerequest); unset fields are left unset."""

    prompt: str = ""
    template: str | None = None
    body: str | None = None
    temperature: float | None = None
    max_tokens: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    force_experts: list[str] = []
    exclude_experts: list[str] = []
    max_experts: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    context_size: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    user_id: str = ""
    priority: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    timeout_ms: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] = []
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    messages: list[ChatMessageBody] = []
    raw: StrictBool = False
    json_schema: str | None = None
    model: str | None = None
    n: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    # OpenAI's shape plus the regex and grammar types, checked part by part in response_format.py
    response_format: dict[str, Any] | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]] = []
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    speculative: StrictBool | None = None
    best_of: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    use_beam_search: StrictBool | None = None
    length_penalty: float | None = None
    # true, false or "never" (transformers' values); InferenceRequest holds it as text
    early_stopping: StrictBool | str | None = None
    tools: list[ToolBody] = []
    # A mode's name alone stands for {"mode": <it>}.
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceBody | None = None
    parallel_tool_calls: StrictBool | None = None


class InferBody(JobBody):
    """`POST /v1/infer`: the request, and `stream` for server-sent events instead of one answer."""

    stream: StrictBool = False


FIELD_NAMES = set(InferBody.model_fields) | set(ChatMessageBody.model_fields)
FIELD_NAMES |= set(ToolBody.model_fields) | set(ToolCallBody.model_fields) | set(ToolChoiceBody.model_fields)
