"""The audit log (docs/operations.md#audit-log): one JSON line per job that reaches a final state.

JobStore.finish writes it, where a job's final result is recorded once (whoever ends the job: the
pipeline, the dead-letter path, the deadline sweep, a CancelJob of a queued job), so every final
state gives exactly one line, on the reception instance that recorded it. The prompt and the output
appear as SHA-256s; their clear text only with EXPERT_AUDIT_CLEAR_TEXT=true.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from libs.gen.expert.v1 import common_pb2
from libs.logging import get_logger

log = get_logger(__name__)

OFF, STDOUT = "off", "stdout"


def prompt_text(request: common_pb2.InferenceRequest) -> str:
    """What the audit log hashes as the prompt: the request's `prompt` as is when it has no
    messages, template or body (a completion); else the canonical JSON of those fields: an object
    with `messages` (a list of {"content", "role"}) and `prompt`, plus `template` and `body` when
    set, keys sorted, no spaces, non-ASCII characters as they are (UTF-8)."""
    if not request.messages and not request.HasField("template") and not request.HasField("body"):
        return request.prompt
    value: dict[str, Any] = {
        "messages": [{"content": m.content, "role": m.role} for m in request.messages],
        "prompt": request.prompt,
    }
    if request.HasField("template"):
        value["template"] = request.template
    if request.HasField("body"):
        value["body"] = request.body
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _enum_name(enum, prefix: str, value: int) -> str | None:
    name = enum.Name(value) if value in enum.values() else None
    return None if name is None or name.endswith("_UNSPECIFIED") else name.removeprefix(prefix)


def audit_line(
    job_id: str,
    request: common_pb2.InferenceRequest | None,
    result: common_pb2.InferenceResult,
    *,
    model: str | None = None,
    key_id: str | None = None,
    clear_text: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """The audit record of a job that ended with `result`. `request` None: its record was gone
    (the prompt fields are then null). `key_id`: the id of the API key that submitted the job
    (never the key), None with auth off or for a job a service submitted."""
    prompt = None if request is None else prompt_text(request)
    output = result.text
    line: dict[str, Any] = {
        "time": datetime.fromtimestamp(time.time() if now is None else now, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "job_id": job_id,
        "key_id": key_id,
        "user": (request.user_id or None) if request is not None else None,
        "model": model or None,
        "experts": list(result.experts_used),
        "status": _enum_name(common_pb2.JobStatus, "JOB_STATUS_", result.status),
        "finish_reason": _enum_name(common_pb2.FinishReason, "FINISH_REASON_", result.finish_reason),
        "prompt_tokens": result.metrics.input_tokens,
        "completion_tokens": result.metrics.output_tokens or result.tokens_generated,
        "prompt_sha256": None if prompt is None else sha256(prompt),
        "output_sha256": sha256(output),
    }
    if clear_text:
        line["prompt"] = prompt
        line["output"] = output
    return line


class AuditLog:
    """Writes audit lines to `destination`: "off", "stdout", or a file path (created with its
    directory, opened once, appended to, flushed after each line). A failed write logs an error
    and never fails the job. A line is a few hundred bytes: written on the event loop."""

    def __init__(
        self,
        destination: str,
        *,
        clear_text: bool = False,
    ) -> None:
        self.destination = destination
        self.clear_text = clear_text
        self._file: TextIO | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.destination != OFF

    def record(
        self,
        job_id: str,
        request: common_pb2.InferenceRequest | None,
        result: common_pb2.InferenceResult,
        *,
        key_id: str | None = None,
    ) -> None:
        if not self.enabled:
            return
        # The model the job ran on; for a job that never reached planning, the one it asked for.
        model = result.model or (request.model if request is not None and request.HasField("model") else None)
        try:
            line = audit_line(job_id, request, result, model=model, key_id=key_id, clear_text=self.clear_text)
            text = json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
        except Exception:  # never fails the job that ended
            log.exception("audit line not built", job_id=job_id)
            return
        self.write(text)

    def write(self, text: str) -> None:
        try:
            stream = sys.stdout if self.destination == STDOUT else self._open()
            stream.write(text)
            stream.flush()
            self._failed = False
        except (OSError, ValueError) as error:
            if not self._failed:  # once per outage, not once per job
                log.error("audit log write failed", destination=self.destination, error=str(error))
            self._failed = True
            self._close()

    def _open(self) -> TextIO:
        if self._file is None:
            path = Path(self.destination)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        return self._file

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def close(self) -> None:
        self._close()
