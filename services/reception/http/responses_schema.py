"""The request body of OpenAI's Responses API (`POST /v1/responses`, docs/api.md#the-responses-api)
as reception accepts it. The top-level fields are checked here (unknown ones refused, as OpenAI
does); `input`'s items, `text.format`, `tools` and `tool_choice` are free-form here and checked item
by item where they are translated (responses_input.py, responses_request.py), so that an error names
the exact part (`input[2].call_id`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from services.reception.http.openai_schema import INT32

# The longest id a client may name (ours are `resp_` and a 32-character job id).
MAX_RESPONSE_ID_CHARS = 128


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = Field(None, max_length=MAX_RESPONSE_ID_CHARS)
    user: str | None = None
    # Accepted and not acted on: they change nothing about the answer (docs/api.md lists them).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: we send no obfuscation
    # Refused unless they ask for nothing (responses_request.py): we cannot do what they ask.
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


FIELD_NAMES = set(ResponsesRequest.model_fields)
