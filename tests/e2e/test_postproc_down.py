"""Postproc down as jobs end (issue 34): Finalize is retried until the job's deadline (at least 10 s,
reception's FINALIZE_MIN_WAIT_S). A postproc back in time validates the job; one that never comes
back leaves the output recorded as the engine made it, marked `validation_skipped` in the API and
counted in `expert_reception_results_unvalidated_total`."""

from __future__ import annotations

import time

import httpx

from expert_system import ExpertClient
from tests.e2e.test_pipeline import wait_final, wait_status
from tools.stack import free_port


def _unvalidated_count(metrics_url: str) -> float:
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("expert_reception_results_unvalidated_total "):
            return float(line.split()[1])
    raise AssertionError("reception exports no expert_reception_results_unvalidated_total")


def test_finalize_waits_for_postproc_until_the_deadline_then_marks_and_counts_the_result(tiny_stack):
    stack = tiny_stack()
    metrics_port = free_port()
    stack.stop_service("reception")
    stack.start_service("reception", env={"EXPERT_RECEPTION_METRICS_PORT": str(metrics_port)})
    stack.wait_serving("reception")
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    stack.stop_service("postproc")
    options = {"raw": True, "temperature": 0.0, "max_tokens": 8}
    with ExpertClient(stack.target("reception")) as client:
        # Back within the deadline: the job waits for it and is validated.
        job = client.submit(prompt="Hello", timeout_ms=120_000, **options)
        wait_status(client, job.job_id, "postprocessing", timeout=60)
        time.sleep(2.0)  # postproc is still down: the job keeps waiting for it
        assert not client.get_job(job.job_id).is_finished
        stack.start_service("postproc")
        final = wait_final(client, job.job_id, timeout=90)
        assert final.status == "completed" and not final.result.validation_skipped, final.result.error
        assert final.result.validation is not None and final.result.error == ""
        assert _unvalidated_count(metrics_url) == 0

        # Never back: recorded once the deadline (and the 10 s floor) passed, marked and counted.
        stack.stop_service("postproc")
        started = time.monotonic()
        lost = wait_final(client, client.submit(prompt="Hello", timeout_ms=6_000, **options).job_id, 60)
        assert time.monotonic() - started >= 9
    assert lost.status == "completed" and lost.result.text, lost.result.error
    assert lost.result.validation_skipped and lost.result.validation is None
    assert "not validated" in lost.result.error
    assert _unvalidated_count(metrics_url) == 1
    rest = httpx.get(f"{stack.http_url()}/v1/jobs/{lost.job_id}", timeout=5).json()
    assert rest["result"]["validation_skipped"] is True
