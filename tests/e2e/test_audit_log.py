"""The audit log (docs/operations.md#audit-log) on a real stack on the tiny model: one JSON line per
job that ends (completed, cancelled, refused at a stage), hashes by default, clear text on request."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LONG, ready_tiny_stack, wait_ready, wait_rest_job
from tools.stack import LocalStack

FINAL = ("cancelled", "completed", "failed", "timed_out")
PROMPT = "What is the capital of France? (audited)"
FIELDS = {
    "time", "job_id", "key_id", "user", "model", "experts", "status", "finish_reason",
    "prompt_tokens", "completion_tokens", "prompt_sha256", "output_sha256",
}  # fmt: skip


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _lines(path: Path, job_id: str, timeout: float = 10.0) -> list[dict]:
    """The audit lines of `job_id`, once there is one (and a moment for a second to show)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        mine = [line for line in lines if line["job_id"] == job_id]
        if mine:
            time.sleep(0.5)
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            return [line for line in lines if line["job_id"] == job_id]
        time.sleep(0.05)
    pytest.fail(f"no audit line for {job_id} in {path}")


@pytest.fixture(scope="module")
def audited(tiny_llama, tmp_path_factory) -> tuple[LocalStack, Path]:
    root = tmp_path_factory.mktemp("audit-stack")
    audit = root / "audit" / "jobs.log"
    with ready_tiny_stack(tiny_llama, root / "stack", EXPERT_AUDIT_LOG=str(audit)) as stack:
        yield stack, audit


def test_each_final_job_gives_one_line_with_hashes_only(audited, long_prompt):
    stack, audit = audited
    with httpx.Client(base_url=stack.http_url(), timeout=60) as http:
        completed = http.post(
            "/v1/infer", json={"prompt": PROMPT, "temperature": 0.0, "max_tokens": 8, "user_id": "alice"}
        ).json()
        assert completed["status"] == "completed"

        running = http.post(
            "/v1/jobs",
            json={"prompt": long_prompt, "raw": True, "temperature": 0.0, "max_tokens": LONG},
        ).json()
        wait_rest_job(http, running["job_id"], lambda job: job["status"] == "running")
        assert http.delete(f"/v1/jobs/{running['job_id']}").status_code == 200
        cancelled = wait_rest_job(http, running["job_id"], lambda job: job["status"] in FINAL)
        assert cancelled["status"] == "cancelled"

        refused = http.post("/v1/jobs", json={"prompt": PROMPT, "force_experts": ["no-such-expert"]})
        assert refused.status_code == 202
        failed = wait_rest_job(http, refused.json()["job_id"], lambda job: job["status"] in FINAL)
        assert failed["status"] == "failed"

    [line] = _lines(audit, completed["job_id"])
    assert set(line) == FIELDS
    assert line["time"].endswith("Z") and line["key_id"] is None and line["user"] == "alice"
    assert line["status"] == "COMPLETED" and line["finish_reason"] in ("STOP", "LENGTH")
    assert line["experts"] == completed["experts_used"]
    assert line["prompt_tokens"] == completed["metrics"]["input_tokens"] > 0
    assert line["completion_tokens"] == completed["tokens_generated"] > 0
    assert line["prompt_sha256"] == _sha256(PROMPT)
    assert line["output_sha256"] == _sha256(completed["text"])

    [line] = _lines(audit, running["job_id"])
    assert (line["status"], line["finish_reason"], line["user"]) == ("CANCELLED", "ABORT", None)
    assert line["prompt_sha256"] == _sha256(long_prompt)
    assert line["output_sha256"] == _sha256(cancelled["result"]["text"])

    [line] = _lines(audit, failed["job_id"])
    assert (line["status"], line["finish_reason"]) == ("FAILED", "ERROR")
    assert line["prompt_sha256"] == _sha256(PROMPT) and line["completion_tokens"] == 0

    text = audit.read_text()
    assert PROMPT not in text and long_prompt not in text and completed["text"] not in text
    assert len(text.splitlines()) == 3  # one per job, nothing else


def test_clear_text_puts_the_prompt_and_output_in_the_line(tiny_stack):
    stack = tiny_stack(EXPERT_AUDIT_CLEAR_TEXT="true")  # the audit log left to LocalStack's default
    wait_ready(stack)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    with httpx.Client(base_url=stack.http_url(), timeout=60) as http:
        result = http.post(
            "/v1/infer", json={"messages": messages, "temperature": 0.0, "max_tokens": 8}
        ).json()
    assert result["status"] == "completed"
    [line] = _lines(stack.log_dir / "audit.log", result["job_id"])
    canonical = json.dumps(
        {"messages": [{"content": m["content"], "role": m["role"]} for m in messages], "prompt": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert line["prompt"] == canonical and line["prompt_sha256"] == _sha256(canonical)
    assert line["output"] == result["text"] and line["output_sha256"] == _sha256(result["text"])
