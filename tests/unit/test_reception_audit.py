"""The audit log's line builder and writer (docs/operations.md#audit-log), without a server."""

from __future__ import annotations

import hashlib
import json

from libs.gen.expert.v1 import common_pb2
from services.reception.audit import AuditLog, audit_line, prompt_text
from services.reception.config import ReceptionConfig


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _result(**fields) -> common_pb2.InferenceResult:
    result = common_pb2.InferenceResult(
        job_id="j1",
        status=common_pb2.JOB_STATUS_COMPLETED,
        text="Paris.",
        tokens_generated=3,
        experts_used=["german", "json-parser"],
        finish_reason=common_pb2.FINISH_REASON_STOP,
        **fields,
    )
    result.metrics.input_tokens = 12
    result.metrics.output_tokens = 3
    return result


def test_a_completed_job_line_has_every_field_and_no_clear_text():
    request = common_pb2.InferenceRequest(prompt="What is the capital of France?", user_id="alice")
    line = audit_line("j1", request, _result(), model="tiny-llama", now=0.0)
    assert line == {
        "time": "1970-01-01T00:00:00.000Z",
        "job_id": "j1",
        "key_id": None,
        "user": "alice",
        "model": "tiny-llama",
        "experts": ["german", "json-parser"],
        "status": "COMPLETED",
        "finish_reason": "STOP",
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "prompt_sha256": _sha256("What is the capital of France?"),
        "output_sha256": _sha256("Paris."),
    }


def test_clear_text_adds_the_hashed_prompt_and_the_output():
    request = common_pb2.InferenceRequest(prompt="Hi")
    line = audit_line("j1", request, _result(), clear_text=True)
    assert (line["prompt"], line["output"]) == ("Hi", "Paris.")
    assert line["user"] is None and line["model"] is None


def test_messages_template_and_body_are_hashed_as_canonical_json():
    request = common_pb2.InferenceRequest(
        prompt="and?",
        messages=[common_pb2.ChatMessage(role="user", content="Grüße")],
        template="{prompt}: {body}",
        body="doc",
    )
    text = prompt_text(request)
    assert text == (
        '{"body":"doc","messages":[{"content":"Grüße","role":"user"}],"prompt":"and?",'
        '"template":"{prompt}: {body}"}'
    )
    assert audit_line("j1", request, _result())["prompt_sha256"] == _sha256(text)


def test_a_job_ended_without_a_run_or_a_record():
    result = common_pb2.InferenceResult(job_id="j1", status=common_pb2.JOB_STATUS_CANCELLED)
    line = audit_line("j1", None, result)
    assert (line["status"], line["finish_reason"]) == ("CANCELLED", None)
    assert (line["prompt_sha256"], line["user"], line["experts"]) == (None, None, [])
    assert (line["prompt_tokens"], line["completion_tokens"]) == (0, 0)
    assert line["output_sha256"] == _sha256("")


def test_a_file_gets_one_flushed_line_per_job(tmp_path):
    path = tmp_path / "logs" / "audit.log"
    audit = AuditLog(str(path))
    request = common_pb2.InferenceRequest(prompt="secret prompt", model="asked")
    audit.record("j1", request, _result(model="m"))
    audit.record("j2", request, _result())  # ended before planning: the model it asked for
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # flushed, not yet closed
    assert [line["job_id"] for line in lines] == ["j1", "j2"]
    assert [line["model"] for line in lines] == ["m", "asked"]
    assert "secret prompt" not in path.read_text()
    audit.close()


def test_a_failed_write_logs_and_does_not_raise(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    audit = AuditLog(str(blocked / "audit.log"))  # its directory is a file
    audit.record("j1", common_pb2.InferenceRequest(prompt="x"), _result())  # no exception


def test_off_writes_nothing_and_stdout_writes_there(capsys):
    AuditLog("off").record("j1", common_pb2.InferenceRequest(prompt="x"), _result())
    assert capsys.readouterr().out == ""
    AuditLog("stdout").record("j1", common_pb2.InferenceRequest(prompt="x"), _result())
    assert json.loads(capsys.readouterr().out)["job_id"] == "j1"


def test_the_settings():
    assert (ReceptionConfig.from_env({}).audit_log, ReceptionConfig.from_env({}).audit_clear_text) == (
        "stdout",
        False,
    )
    config = ReceptionConfig.from_env({"EXPERT_AUDIT_LOG": "OFF", "EXPERT_AUDIT_CLEAR_TEXT": "true"})
    assert (config.audit_log, config.audit_clear_text) == ("off", True)
    assert ReceptionConfig.from_env({"EXPERT_AUDIT_LOG": "/var/log/a.log"}).audit_log == "/var/log/a.log"
