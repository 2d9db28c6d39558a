"""The request body of the Expert System's own REST API (`/v1/infer`, `/v1/jobs`): the fields of an
InferenceRequest under their proto names. Unknown fields are refused, the integers are bounded to
what the proto's fields hold, and the text to what UTF-8 can carry (body_text.py); every other bound
is reception's validation. `response_format` is the one field in another shape: OpenAI's, as the
SDK and the OpenAI endpoints take it. A JSON schema (a tool's parameters, a call's arguments) may
be an object or its JSON text, and a tool_choice a mode's name alone."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.reception.http.body_text import Text

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallBody(_Body):
    """A call in an assistant message: ToolCall's fields, the arguments an object or its JSON text."""

    id: Text = ""
    type: Text = "function"
    name: Text
    arguments: dict[str, Any] | Text = ""


class ChatMessageBody(_Body):
    role: Text
    # required, but on an assistant message with tool_calls (rest.py checks it)
    content: Text | None = None
    name: Text = ""
    tool_call_id: Text = ""
    tool_calls: list[ToolCallBody] = []


class ToolBody(_Body):
    """A Tool: its parameter schema an object or its JSON text."""

    name: Text
    description: Text = ""
    parameters: dict[str, Any] | Text = ""
    strict: bool = False


class ToolChoiceBody(_Body):
    """A ToolChoice: a `mode` or the `function` to call (exactly one: reception's validation)."""

    mode: Literal["none", "auto", "required"] | None = None
    function: Text | None = None


class JobBody(_Body):
    """An InferenceRequest as JSON (docs/api.md#inferencerequest); unset fields are left unset."""

    prompt: Text = ""
    template: Text | None = None
    body: Text | None = None
    temperature: float | None = None
    max_tokens: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    force_experts: list[Text] = []
    exclude_experts: list[Text] = []
    max_experts: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    context_size: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    user_id: Text = ""
    priority: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    timeout_ms: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[Text] = []
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    messages: list[ChatMessageBody] = []
    raw: bool = False
    json_schema: Text | None = None
    model: Text | None = None
    n: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    # OpenAI's shape plus the regex and grammar types, checked part by part in response_format.py
    response_format: dict[str, Any] | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]] = []
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    speculative: bool | None = None
    best_of: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # true, false or "never" (transformers' values); InferenceRequest holds it as text
    early_stopping: bool | Text | None = None
    tools: list[ToolBody] = []
    # A mode's name alone stands for {"mode": <it>}.
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None


class InferBody(JobBody):
    """`POST /v1/infer`: the request, and `stream` for server-sent events instead of one answer."""

    stream: bool = False


FIELD_NAMES = set(InferBody.model_fields) | set(ChatMessageBody.model_fields)
FIELD_NAMES |= set(ToolBody.model_fields) | set(ToolCallBody.model_fields) | set(ToolChoiceBody.model_fields)
