"""Redis outages with jobs in flight (issue 34): Redis, with its append-only file as `make run` runs
it, is killed (SIGKILL) and started again after 5, 15, 25 and 45 s while 20 jobs are queued and
running; and once stalled (SIGSTOP, then SIGCONT 15 s later: connections stay open and every command
waits, as for a Redis that hangs).

Every job completes. A job's dispatcher renews its lease on the job's queue entry while the job
runs; the outage lets every lease lapse, but no dispatcher takes over a job whose dispatcher is
alive, so a job that waited the outage out on its dispatcher runs once. Past the 30 s a running
job's writes wait for Redis (reception's WRITE_PATIENCE_S), its dispatcher gives it up and a
dispatcher runs it again once Redis is back: at most twice, never with an engine request id in use.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from expert_system import ExpertClient
from tests.e2e.conftest import TINY_SETTINGS, client_engines, stack_env
from tests.e2e.test_pipeline import wait_final
from tools.stack import REDIS, LocalStack

WRITE_PATIENCE_S = 30  # services/reception/jobs.py
JOBS = 20
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def durable_stack(tiny_llama, tmp_path_factory):
    env = stack_env(tiny_llama, **(TINY_SETTINGS | {"EXPERT_MAX_NUM_SEQS": "8"}))
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("outages"), env=env, redis_durable=True)
    stack.start()
    yield stack
    stack.stop()


def _stall(stack: LocalStack, seconds: float) -> None:
    pid = stack.supervised()[REDIS].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the fault's length, not a wait for a condition
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize(
    ("fault", "outage_s"), [("kill", 5), ("kill", 15), ("kill", 25), ("kill", 45), ("stall", 15)]
)
def test_a_redis_outage_with_jobs_in_flight_loses_no_job_and_runs_no_live_job_twice(
    durable_stack, long_prompt, fault, outage_s
):
    stack = durable_stack
    options = {"raw": True, "temperature": 0.0, "repetition_penalty": 1.0, "timeout_ms": 600_000}
    with ExpertClient(stack.target("reception")) as client:
        jobs = [
            client.submit(prompt=long_prompt, max_tokens=MAX_TOKENS, **options).job_id for _ in range(JOBS)
        ]
        deadline = time.monotonic() + 60
        while not any(e.active_jobs for e in client_engines(stack)):
            assert time.monotonic() < deadline, "no job was ever placed"
            time.sleep(0.01)
        if fault == "kill":
            stack.restart_redis(down_s=outage_s)
        else:
            _stall(stack, outage_s)
        finals = [wait_final(client, job_id, timeout=300) for job_id in jobs]
    assert [f.status for f in finals] == ["completed"] * JOBS, [(f.status, f.result.error) for f in finals]
    assert all(f.result.tokens_generated == MAX_TOKENS for f in finals)
    # a stalled Redis keeps the connections: writes wait for it however long, and nobody gives up
    most = 1 if outage_s < WRITE_PATIENCE_S or fault == "stall" else 2
    assert max(f.attempts for f in finals) <= most, [f.attempts for f in finals]
    assert "already in use" not in stack.log_path("engine").read_text()
    deadline = time.monotonic() + 15
    while [e.active_jobs for e in client_engines(stack)] != [0]:
        assert time.monotonic() < deadline, "engine slots were not given back"
        time.sleep(0.1)
