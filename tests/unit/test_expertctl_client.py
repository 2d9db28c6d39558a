"""`expertctl infer|stream|submit|job|cancel|engines`: what they print, what they send, and how
they fail (one `expertctl: error:` line per problem, never a traceback, exit 2 for bad input).

The server is a test double (tests/helpers/fake_reception.py) with predictable behaviour, not the
reception or preparation: these tests are about the command line's translation between options,
the SDK and the terminal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from libs.gen.expert.v1 import common_pb2
from tests.helpers.fake_reception import TRACE, serve_fakes, unused_port
from tools.expertctl.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fakes():
    with serve_fakes() as server:
        yield server


@pytest.fixture
def run(fakes, capsys):
    """`expertctl ARGS --target <the fakes>` -> (status, stdout, stderr)."""

    def run(*args: str):
        status = main([*args, "--target", fakes.target])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def test_infer_prints_the_text_then_a_summary(run):
    status, out, err = run("infer", "Parse this JSON", "--force-expert", "json-parser")
    assert (status, out) == (0, "Parse this JSON\n")
    assert err.startswith("job job-") and err.count("\n") == 1
    assert "experts: json-parser | latency: 812 ms | tokens: 3 | finish: stop" in err


def test_infer_summary_says_none_without_experts_and_flags_a_timeout(run):
    status, out, err = run("infer", "a long story", "--timeout-ms", "50")
    assert (status, out) == (0, "a\n")
    assert "experts: none" in err and err.rstrip().endswith("finish: timeout | TIMED OUT (partial output)")


def test_infer_options_become_request_fields(run, fakes, tmp_path):
    (tmp_path / "body.json").write_text('{"name": "Alice"}')
    (tmp_path / "schema.json").write_text('{"type": "object"}')
    status, _, _ = run(
        "infer", "Extract fields", "--body", f"@{tmp_path / 'body.json'}", "--template", "{prompt}: {body}",
        "--system", "Be brief.", "--temperature", "0.25", "--max-tokens", "64", "--top-p", "0.5",
        "--top-k", "40", "--min-p", "0.125", "--repetition-penalty", "1.5", "--presence-penalty", "-0.5",
        "--frequency-penalty", "0.5", "--stop", "END", "--stop", "\n\n", "--seed", "7", "--priority", "9",
        "--timeout-ms", "30000", "--force-expert", "json-parser", "--exclude-expert", "poet",
        "--exclude-expert", "bard", "--max-experts", "2", "--context-size", "4096", "--raw",
        "--json-schema", str(tmp_path / "schema.json"),
    )  # fmt: skip
    assert status == 0
    assert fakes.reception.last_request == common_pb2.InferenceRequest(
        prompt="Extract fields",
        body='{"name": "Alice"}',
        template="{prompt}: {body}",
        messages=[common_pb2.ChatMessage(role="system", content="Be brief.")],
        temperature=0.25,
        max_tokens=64,
        top_p=0.5,
        top_k=40,
        min_p=0.125,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.5,
        stop=["END", "\n\n"],
        seed=7,
        priority=9,
        timeout_ms=30000,
        force_experts=["json-parser"],
        exclude_experts=["poet", "bard"],
        max_experts=2,
        context_size=4096,
        raw=True,
        response_format=common_pb2.ResponseFormat(json_schema={"schema": '{"type": "object"}'}),
    )


def test_beam_search_options_become_request_fields(run, fakes):
    status, _, _ = run(
        "infer", "Finish this", "--n", "2", "--best-of", "4", "--beam-search", "--length-penalty", "0.5",
        "--early-stopping", "never",
    )  # fmt: skip
    assert status == 0
    assert fakes.reception.last_request == common_pb2.InferenceRequest(
        prompt="Finish this", n=2, best_of=4, use_beam_search=True, length_penalty=0.5, early_stopping="never"
    )
    assert run("infer", "Finish this", "--early-stopping", "soon")[0] == 2  # a usage error


@pytest.mark.parametrize(("option", "value"), [("--speculative", True), ("--no-speculative", False)])
def test_speculative_decoding_is_turned_on_or_off_per_request(run, fakes, option, value):
    assert run("infer", "Copy this", option)[0] == 0
    request = fakes.reception.last_request
    assert request.HasField("speculative") and request.speculative is value
    assert run("infer", "Copy this")[0] == 0
    assert not fakes.reception.last_request.HasField("speculative")  # the engine's setting


@pytest.mark.parametrize("command", ["infer", "stream", "submit"])
def test_a_regex_or_a_grammar_file_becomes_the_requests_format(run, fakes, tmp_path, command):
    assert run(command, "Phone?", "--regex", "[0-9]{3}-[0-9]{4}")[0] == 0
    assert fakes.reception.last_request.response_format == common_pb2.ResponseFormat(
        regex="[0-9]{3}-[0-9]{4}"
    )
    grammar = 'start: "yes" | "no"\n'
    (tmp_path / "answer.lark").write_text(grammar)
    assert run(command, "Yes or no?", "--grammar", str(tmp_path / "answer.lark"))[0] == 0
    assert fakes.reception.last_request.response_format == common_pb2.ResponseFormat(grammar=grammar)
    assert not fakes.reception.last_request.HasField("json_schema")


def test_at_most_one_format_option_is_given(run, fakes, tmp_path):
    sent = len(fakes.reception.requests)
    (tmp_path / "schema.json").write_text("{}")
    status, _, err = run("infer", "hello", "--regex", "a+", "--json-schema", str(tmp_path / "schema.json"))
    assert status == 2
    assert "expertctl: error: argument --json-schema: not allowed with argument --regex" in err
    status, _, err = run("infer", "hello", "--grammar", "/no/such.lark")
    assert (status, err) == (
        2,
        "expertctl: error: --grammar: cannot read /no/such.lark: No such file or directory\n",
    )
    (tmp_path / "bad.json").write_text("{not json")
    status, _, err = run("infer", "hello", "--json-schema", str(tmp_path / "bad.json"))
    assert status == 2 and err.startswith(
        f"expertctl: error: --json-schema: {tmp_path / 'bad.json'} is not JSON"
    )
    assert len(fakes.reception.requests) == sent


def test_infer_without_options_leaves_the_fields_to_the_router(run, fakes):
    assert run("infer", "hello")[0] == 0
    assert fakes.reception.last_request == common_pb2.InferenceRequest(prompt="hello")


def test_infer_trace_prints_the_reasoning_trace(run):
    status, _, err = run("infer", "hello", "--trace")
    assert status == 0 and f"reasoning trace:\n{TRACE}\n" in err


def test_infer_json_prints_the_whole_result_as_one_object(run):
    status, out, err = run("infer", "hello world", "--json", "--force-expert", "summarizer")
    assert status == 0 and err == ""
    result = json.loads(out)
    assert (result["text"], result["status"], result["finish_reason"]) == ("hello world", "completed", "stop")
    assert result["experts_used"] == ["summarizer"] and result["experts"][0]["adapter_type"] == "lora"
    assert result["metrics"]["submitted_at"] == "2026-01-02T03:04:05+00:00"


def test_a_failed_job_exits_1_after_its_summary(run):
    status, _, err = run("infer", "fail now")
    assert status == 1 and "finish: error" in err
    assert err.splitlines()[-1].endswith("failed: the engine crashed")


def test_a_job_refused_for_its_fields_reports_them_with_status_2(run):
    status, _, err = run("infer", "refuse this")
    assert status == 2
    assert err.splitlines()[-1] == "expertctl: error: request.max_tokens: exceeds the context window 2048"


def test_field_violations_are_one_error_line_each_with_status_2(run):
    status, out, err = run("infer", "hello", "--temperature", "2.5", "--priority", "12")
    assert (status, out) == (2, "")
    assert err == (
        "expertctl: error: request.temperature: must be in [0, 2], got 2.5\n"
        "expertctl: error: request.priority: must be in [0, 9], got 12\n"
    )


def test_bad_option_values_are_usage_errors_before_any_call(run, fakes):
    sent = len(fakes.reception.requests)
    for args in (["--temperature", "abc"], ["--seed", "-1"], ["--max-tokens", str(2**31)]):
        status, _, err = run("infer", "hello", *args)
        assert status == 2 and "expertctl: error: argument " in err and "Traceback" not in err
    status, _, err = run("infer", "hello", "--body", "@/no/such/file")
    assert status == 2
    assert err == "expertctl: error: --body: cannot read /no/such/file: No such file or directory\n"
    assert len(fakes.reception.requests) == sent


@pytest.mark.parametrize("command", [["infer", "hello"], ["stream", "hello"], ["job", "job-1"], ["engines"]])
def test_an_unreachable_service_is_named_with_a_hint(command, capsys):
    target = f"127.0.0.1:{unused_port()}"
    assert main([*command, "--target", target]) == 1
    service = "preparation" if command == ["engines"] else "reception"
    assert capsys.readouterr().err == (
        f"expertctl: error: cannot reach {service} at {target} (is the stack running? make run)\n"
    )


def test_the_default_target_comes_from_the_environment(monkeypatch, capsys):
    port = unused_port()
    monkeypatch.setenv("EXPERT_RECEPTION_TARGET", f"127.0.0.1:{port}")
    assert main(["infer", "hello"]) == 1
    assert f"cannot reach reception at 127.0.0.1:{port} " in capsys.readouterr().err


def test_stream_prints_the_text_then_the_summary(run):
    status, out, err = run("stream", "Write a story")
    assert (status, out) == (0, "Write a story\n")
    assert "tokens: 3 | finish: stop" in err


def test_stream_announces_a_restart_on_stderr(run):
    status, out, err = run("stream", "please restart this job")
    assert status == 0 and out == "please restart \nplease restart this job\n"
    assert err.startswith("[the job restarted (attempt 2): its text starts over]\n")


def test_stream_json_prints_one_object_per_chunk_then_the_result(run):
    status, out, _ = run("stream", "please restart it", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 0 and lines[2] == {
        "text": "",
        "restarted": True,
        "attempt": 2,
        "index": 0,
        "logprobs": [],
        "tool_calls": [],
    }
    assert "".join(line["text"] for line in lines[3:-1]) == "please restart it"
    assert lines[-1]["result"]["text"] == "please restart it"


def test_infer_and_stream_print_each_choice_and_its_logprobs(run, fakes):
    status, out, _ = run("infer", "Paris is", "--n", "2", "--logprobs", "1")
    assert status == 0 and fakes.reception.requests[-1].n == 2 and fakes.reception.requests[-1].logprobs == 1
    assert out == (
        "--- choice 0 (stop) ---\nParis is\n"
        "    -1.0000  'Paris'  ['alt0' -0.500]\n"
        "    -2.0000  'is'  ['alt0' -0.500]\n"
        "--- choice 1 (stop) ---\nParis is\n"
        "    -1.0000  'Paris'  ['alt0' -0.500]\n"
        "    -2.0000  'is'  ['alt0' -0.500]\n"
    )
    status, streamed, _ = run("stream", "Paris is", "--n", "2", "--logprobs", "1")
    assert status == 0 and streamed == out


def test_stream_refusal_is_reported_like_infer(run):
    status, out, err = run("stream", "hello", "--temperature", "3")
    assert (status, out) == (2, "")
    assert err == "expertctl: error: request.temperature: must be in [0, 2], got 3\n"


def test_submit_prints_the_job_id_and_job_shows_it(run):
    status, out, err = run("submit", "slow work ahead", "--priority", "8")
    job_id = out.strip()
    assert status == 0 and job_id.startswith("job-") and "estimated wait 1.50 s" in err
    status, out, _ = run("job", job_id)
    assert status == 0
    assert f"job        {job_id}\n" in out and "status     running\n" in out and "priority   8\n" in out
    assert "submitted  2026-01-02 03:04:05.000 UTC\n" in out and "finished   -\n" in out
    assert out.endswith("--- text so far ---\nslow\n")


def test_job_shows_a_finished_result(run):
    job_id = run("submit", "quick work")[1].strip()
    status, out, _ = run("job", job_id)
    assert status == 0 and "status     completed\n" in out and "--- result ---\nquick work\n" in out
    assert "finish: stop" in out


def test_submit_job_and_cancel_print_json(run):
    status, out, _ = run("submit", "slow json", "--json")
    submission = json.loads(out)
    assert status == 0 and submission["status"] == "queued" and submission["estimated_wait_ms"] == 1500
    job = json.loads(run("job", submission["job_id"], "--json")[1])
    assert job["status"] == "running" and job["text"] == "slow" and job["result"] is None
    status, out, _ = run("cancel", submission["job_id"], "--json")
    assert status == 0 and json.loads(out)["status"] == "cancelled"


def test_cancel_prints_the_new_status(run):
    job_id = run("submit", "slow to cancel")[1].strip()
    assert run("cancel", job_id)[:2] == (0, f"job {job_id}: cancelled\n")


def test_an_unknown_job_is_one_error_line_with_status_1(run):
    for command in ("job", "cancel"):
        status, out, err = run(command, "job-missing")
        assert (status, out, err) == (1, "", "expertctl: error: job 'job-missing' not found\n")


def test_engines_prints_a_table(run):
    status, out, _ = run("engines")
    header, first, second = out.splitlines()
    assert status == 0
    assert " ".join(header.split()) == "ENGINE ADDRESS MODEL KV FREE/TOTAL RUNNING WAITING HEARTBEAT"
    assert first.split()[:6] == ["engine-a", "10.0.0.5:50054", "SmolLM2-135M-Instruct", "1500/2048", "3", "1"]
    assert first.endswith(" s ago") and second.split()[3:] == ["512/512", "0", "0", "never"]


def test_engines_json(run):
    status, out, _ = run("engines", "--json")
    engines = json.loads(out)
    assert status == 0 and [e["engine_id"] for e in engines] == ["engine-a", "engine-b"]
    assert engines[0]["load"]["kv_blocks_free"] == 1500 and engines[0]["model"]["num_layers"] == 30
    # The checkpoint's sampling as the file wrote it, and only what it set.
    assert engines[0]["model"]["sampling_defaults"] == {"temperature": 0.7, "top_k": 20}
    assert 1.0 < engines[0]["heartbeat_age_s"] < 60 and engines[1]["last_heartbeat"] is None


def test_engines_says_when_there_are_none(run, fakes, monkeypatch):
    monkeypatch.setattr(fakes.preparation, "engines", [])
    assert run("engines")[:2] == (0, "no engines registered\n")


def _expertctl(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tools.expertctl.main", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_the_process_reports_a_refusal_without_a_traceback(fakes):
    process = _expertctl("infer", "hello", "--temperature", "5", "--target", fakes.target)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out) == (2, "")
    assert err == "expertctl: error: request.temperature: must be in [0, 2], got 5\n"


@pytest.mark.skipif(os.name != "posix", reason="SIGINT stands for Ctrl-C on POSIX")
def test_ctrl_c_cancels_the_stream_and_exits_130(fakes):
    fakes.reception.stream_cancelled.clear()
    process = _expertctl("stream", "forever", "--target", fakes.target)
    try:
        assert process.stdout.read(5) == "tick "  # the stream is running
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert err.startswith("expertctl: error: cancelled job job-") and "Traceback" not in err
    assert fakes.reception.stream_cancelled.wait(5)
