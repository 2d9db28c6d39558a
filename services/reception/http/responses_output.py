"""A chat completion (or its streamed chunks) as a Responses API response (or its typed events):
the answer's text is one `message` output item with an `output_text` part, each tool call a
`function_call` item; `finish_reason` `length` makes the response `incomplete` (max_output_tokens).
Ids derive from the job's: `resp_<job>`, `msg_<job>`, `fc_<job>_<i>`."""

from __future__ import annotations

import copy
import time
from typing import Any

from services.reception.http.responses_schema import ResponsesRequest


def response_shell(body: ResponsesRequest, job_id: str) -> dict[str, Any]:
    """The response for `body` before it has output: what the request asked for, echoed."""
    text_format = (body.text or {}).get("format") or {"type": "text"}
    return {
        "id": "resp_" + job_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": text_format},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": list(body.tools or []),
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's status and incomplete_details for how its one choice finished."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def message_item(job_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": "msg_" + job_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def call_item(job_id: str, i: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{job_id}_{i}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def finished(
    shell: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None, chat_usage: dict | None
) -> dict[str, Any]:
    """The response `shell` finished with `output` items."""
    status, details = _status(finish_reason)
    return {
        **shell,
        "status": status,
        "incomplete_details": details,
        "output": output,
        "usage": usage(chat_usage),
    }


def from_completion(shell: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """The response for a (non-streamed, one-choice) chat completion."""
    (choice,) = completion["choices"]
    message, job_id = choice["message"], completion["expert_system"]["job_id"]
    item_status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = message.get("tool_calls") or []
    output = (
        [message_item(job_id, message.get("content") or "", item_status)]
        if message.get("content") or not calls
        else []
    )
    for i, call in enumerate(calls):
        function = call["function"]
        output.append(call_item(job_id, i, call["id"], function["name"], function["arguments"], "completed"))
    response = finished(shell, output, choice["finish_reason"], completion.get("usage"))
    response["expert_system"] = {**completion["expert_system"], **shell.get("expert_system", {})}
    return response


def assistant_message(response: dict[str, Any]) -> dict[str, Any]:
    """A response's output as the chat assistant message that continues its conversation."""
    text = "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in response["output"]
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def snapshot(response: dict[str, Any]) -> dict[str, Any]:
    """A copy of the response as it is now, for an event (later changes do not reach it)."""
    return copy.deepcopy(response)
