"""Exactly one Release per placement, end to end: 50 mixed jobs (completed, cancelled while queued
or running, timed out, moved off an engine killed under them) on a stack of two engines. Counted
from preparation's own record of each call: its debug log has one line per placement it answered
and one per job named in a Release."""

from __future__ import annotations

import json
import time
from collections import Counter

from expert_system import ExpertClient
from tests.e2e.conftest import client_engines, long_job
from tests.e2e.test_pipeline import wait_final


def _calls(log_path) -> tuple[Counter[str], Counter[str]]:
    placed: Counter[str] = Counter()
    released: Counter[str] = Counter()
    for line in log_path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("event") == "job placed":
            placed[record["job_id"]] += 1
        elif record.get("event") == "job released":
            released[record["job_id"]] += 1
    return placed, released


def _wait_running_or(client: ExpertClient, job_id: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and client.get_job(job_id).status not in ("running", "postprocessing"):
        time.sleep(0.02)


def test_every_placement_is_released_exactly_once_over_50_mixed_jobs(tiny_stack, long_prompt):
    stack = tiny_stack(EXPERT_LOG_LEVEL="debug")
    stack.start_engine("second")
    kinds: dict[str, str] = {}
    with ExpertClient(stack.target("reception")) as client:
        deadline = time.monotonic() + 60
        while len(client_engines(stack)) < 2:
            assert time.monotonic() < deadline, "the second engine never registered"
            time.sleep(0.1)

        # Long jobs over both engines; the second engine is killed under the ones it runs.
        for _ in range(10):
            kinds[long_job(client, long_prompt).job_id] = "moved"
        deadline = time.monotonic() + 60
        while not any(e.engine_id == "second" and e.active_jobs for e in client_engines(stack)):
            assert time.monotonic() < deadline, "no job was placed on the second engine"
            time.sleep(0.02)
        time.sleep(0.3)  # its streams are under way
        stack.kill("second")

        for i in range(20):
            kinds[client.submit(prompt=f"Hello {i}", raw=True, temperature=0.0, max_tokens=8).job_id] = (
                "short"
            )
        for _ in range(10):
            kinds[long_job(client, long_prompt, timeout_ms=2000).job_id] = "timeout"
        cancelled = [long_job(client, long_prompt).job_id for _ in range(10)]
        kinds.update(dict.fromkeys(cancelled, "cancel"))
        for job_id in cancelled[:5]:
            client.cancel(job_id)  # most of these are still queued
        for job_id in cancelled[5:]:
            _wait_running_or(client, job_id, 5.0)
            client.cancel(job_id)

        finals = {job_id: wait_final(client, job_id, timeout=300) for job_id in kinds}
        remaining = client_engines(stack)

    statuses = Counter((kinds[j], f.status) for j, f in finals.items())
    # A long job can still end before its cancel or deadline lands; the mix must hold every kind.
    allowed = {"moved": {"completed"}, "short": {"completed"}, "timeout": {"timed_out", "completed"}}
    allowed["cancel"] = {"cancelled", "completed"}
    assert all(status in allowed[kind] for kind, status in statuses), statuses
    assert {"cancelled", "timed_out", "completed"} <= {status for _, status in statuses}, statuses
    assert [e.active_jobs for e in remaining] == [0]  # nothing held on the surviving engine

    placed, released = _calls(stack.log_dir / "preparation.log")
    assert set(placed) <= set(kinds) and set(released) <= set(kinds)
    for job_id, kind in kinds.items():
        assert released[job_id] == placed[job_id], (kind, job_id, placed[job_id], released[job_id])
    assert all(placed[j] for j, kind in kinds.items() if kind in ("moved", "short"))
    # The kill did move jobs: those it hit were placed twice and released twice.
    assert any(placed[j] == 2 for j, kind in kinds.items() if kind == "moved")
