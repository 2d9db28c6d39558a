"""A streamed chat completion's chunks as the Responses API's typed events, numbered by
`sequence_number`: response.created and .in_progress; for the text, output_item.added,
content_part.added, output_text.delta...; for each tool call, output_item.added and
function_call_arguments.delta...; at the end each open item's .done events (output_text.done,
content_part.done, function_call_arguments.done, output_item.done) and response.completed (or
response.incomplete at max_output_tokens). A failure is an `error` event and response.failed."""

from __future__ import annotations

from typing import Any

from services.reception.http.responses_output import call_item, finished, message_item, snapshot


class ResponseEvents:
    """The events of one streamed response, from the chat chunks of its job `job_id`."""

    def __init__(self, shell: dict[str, Any], job_id: str) -> None:
        self.response, self.job_id = shell, job_id
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the text's item while it is open
        self.calls: dict[int, dict[str, Any]] = {}  # the chat tool call's index -> its open item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.extra: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=snapshot(self.response)),
            self._event("response.in_progress", response=snapshot(self.response)),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (its text, its tool-call deltas; its finish and usage kept)."""
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if "expert_system" in chunk:
            self.extra = chunk["expert_system"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = [] if self.message is not None else self._open_message()
        part = self.message["content"][0]
        part["text"] += text
        index = self.output.index(self.message)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = message_item(self.job_id, "", "in_progress")
        self.output.append(self.message)
        index, item = len(self.output) - 1, self.message
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        opened = {**item, "content": []}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool call's delta: its first opens its item (the text before it is done then)."""
        events: list[dict[str, Any]] = []
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            events += self._close_message("completed")
            item = call_item(
                self.job_id, index, delta.get("id") or "", function.get("name") or "", "", "in_progress"
            )
            self.calls[index] = item
            self.output.append(item)
            events.append(
                self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))
            )
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=function["arguments"],
                )
            )
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self.message is None:
            return []
        item, self.message = self.message, None
        index, part = self.output.index(item), item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=dict(part)),
            self._event("response.output_item.done", output_index=index, item=snapshot(item)),
        ]

    def ending(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the finished response (the last event carries it)."""
        events: list[dict[str, Any]] = []
        if not self.output:  # nothing was generated: still one (empty) message, as non-streamed
            events += self._open_message()
        text_status = "incomplete" if self.finish_reason == "length" else "completed"
        events += self._close_message(text_status)
        for item in self.calls.values():
            item["status"] = "completed"
            index = self.output.index(item)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=snapshot(item)))
        response = finished(self.response, self.output, self.finish_reason, self.usage)
        if self.extra is not None:
            response["expert_system"] = {**self.extra, **self.response.get("expert_system", {})}
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=snapshot(response)))
        return events, response

    def failure(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """A failed job's events: the error (as OpenAI's stream gives it) and response.failed."""
        code = error.get("code") or "server_error"
        failed = {**self.response, "status": "failed", "output": self.output}
        failed["error"] = {"code": code, "message": error.get("message", "")}
        return [
            self._event(
                "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
            ),
            self._event("response.failed", response=snapshot(failed)),
        ]
