"""Failures on the tiny model: a dispatcher killed mid-job (its job is reclaimed and completes), an
engine killed mid-stream (its jobs wait for it to restart, or run elsewhere, never hang), a router
restarting under a job (the job waits for it), and the engine's health before it is warm."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from grpc_health.v1 import health_pb2

from expert_system import ExpertClient
from tests.e2e.conftest import LONG, client_engines, long_job, openai_client
from tests.e2e.test_pipeline import wait_final, wait_status
from tools.stack import free_port, health_status


def test_a_job_whose_dispatcher_dies_is_reclaimed_and_completes(tiny_stack, long_prompt):
    stack = tiny_stack()
    with ExpertClient(stack.target("reception")) as client:
        expected = client.infer(
            prompt=long_prompt, raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0
        ).text
        job = long_job(client, long_prompt)
        wait_status(client, job.job_id, "running")
    stack.kill("reception")  # the dispatcher dies mid-job; its queue entry stays pending
    stack.start_service("reception")  # a new reception (and dispatcher) takes over
    stack.wait_serving("reception")
    with ExpertClient(stack.target("reception")) as client:
        final = wait_final(client, job.job_id, timeout=120)
    assert final.status == "completed" and final.attempts == 2
    assert final.result.text == expected  # greedy: the rerun gives the same text
    assert len(final.result.text) > 0


def test_an_engine_killed_with_jobs_running_loses_none_once_it_is_restarted(tiny_stack, long_prompt):
    """SIGKILL the only engine with 11 jobs placed or queued (two streamed: a greedy one on gRPC, a
    seeded sampled one on OpenAI's API), submit 10 more right after, and start the engine
    again as the supervisor would: every job completes. The running ones waited for the engine
    (preparation dropped the dead process at their first failed call) and went on from the tokens
    their callers had: each stream is one seamless output, without a restart or an error event,
    equal to an uninterrupted run's."""
    stack = tiny_stack()
    options = {"raw": True, "temperature": 0.0, "repetition_penalty": 1.0, "timeout_ms": 300_000}
    openai = openai_client(stack)
    model = openai.models.list().data[0].id
    sampled = {"model": model, "prompt": long_prompt, "max_tokens": LONG, "temperature": 1.0, "seed": 7}
    with ExpertClient(stack.target("reception")) as client, ThreadPoolExecutor(2) as pool:
        expected = client.infer(prompt=long_prompt, max_tokens=LONG, **options).text
        uninterrupted = openai.completions.create(**sampled).choices[0]
        started = [threading.Event() for _ in range(2)]
        stream = client.infer_stream(prompt=long_prompt, max_tokens=LONG, **options)
        streamed = pool.submit(_follow_grpc, stream, started[0])
        openai_stream = pool.submit(
            _follow_openai, openai.completions.create(stream=True, **sampled), started[1]
        )
        # The streams first, then the rest: queued behind the nine, a stream could start only after
        # the other stream had already ended, and the kill would find it finished.
        assert all(event.wait(120) for event in started), "a streamed job never started"
        first = [client.submit(prompt=long_prompt, max_tokens=LONG, **options).job_id for _ in range(9)]
        stack.kill("engine")
        later = [client.submit(prompt=long_prompt, max_tokens=64, **options).job_id for _ in range(10)]
        stack.start_service("engine")
        chunks = streamed.result(timeout=300)
        resumed = wait_final(client, stream.result.job_id, timeout=60)
        openai_text = openai_stream.result(timeout=300)
        finals = [wait_final(client, job_id, timeout=300) for job_id in first + later]
    assert [f.status for f in finals] == ["completed"] * 19, [(f.status, f.result.error) for f in finals]
    assert [f.result.text for f in finals[:9]] == [expected] * 9  # the resumed ones too
    assert resumed.attempts == 2  # it ran on the killed engine, then on its restart
    assert stream.result.status == "completed", stream.result.error
    assert not any(c.restarted for c in chunks)
    assert "".join(c.text for c in chunks) == stream.result.text == expected
    assert stream.result.tokens_generated == LONG
    assert openai_text == (uninterrupted.text, uninterrupted.finish_reason)  # no error event either
    _wait(lambda: [e.active_jobs for e in client_engines(stack)] == [0], timeout=15)


def _follow_grpc(stream, started: threading.Event) -> list:
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.text:
            started.set()
    return chunks


def _follow_openai(stream, started: threading.Event) -> tuple[str, str | None]:
    """An OpenAI completion stream read to its end (an error event raises): its text, its finish."""
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if text:
            started.set()
    return text, finish


def test_a_job_moves_to_another_engine_when_its_engine_dies(tiny_stack, long_prompt, tmp_path):
    stack = tiny_stack()
    # a second engine process registers with the same preparation
    second = stack.service_env() | {
        "EXPERT_ENGINE_PORT": str(free_port()),
        "EXPERT_ENGINE_ID": "second",
        "EXPERT_ENGINE_METRICS_PORT": "0",
    }
    second["EXPERT_ENGINE_ADVERTISE_ADDRESS"] = f"localhost:{second['EXPERT_ENGINE_PORT']}"
    log = open(tmp_path / "second-engine.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "services.engine"], env=second, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        _wait(
            lambda: (
                health_status(second["EXPERT_ENGINE_ADVERTISE_ADDRESS"])
                == health_pb2.HealthCheckResponse.SERVING
            )
        )
        with ExpertClient(stack.target("reception")) as client:
            _wait(lambda: len(client_engines(stack)) == 2)
            expected = client.infer(
                prompt=long_prompt, raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0
            ).text
            job = long_job(client, long_prompt)
            wait_status(client, job.job_id, "running")
            engine = _engine_of(stack, job.job_id)
            if engine == "second":
                process.kill()
            else:
                stack.kill("engine")
            final = wait_final(client, job.job_id, timeout=120)
        assert final.status == "completed" and final.result.text == expected
    finally:
        process.kill()
        process.wait()


def test_a_job_waits_for_a_router_that_is_restarting(tiny_stack):
    """A router that answers UNAVAILABLE is waited for, up to the job's deadline: a router being
    replaced does not fail the jobs dispatched meanwhile, however long it takes to load."""
    stack = tiny_stack()
    stack.stop_service("router")
    with ExpertClient(stack.target("reception")) as client:
        job = client.submit(prompt="Hello", temperature=0.0, max_tokens=4)
        time.sleep(1.0)  # the dispatcher has taken the job and found the router down
        assert not client.get_job(job.job_id).is_finished
        stack.start_service("router")
        final = wait_final(client, job.job_id, timeout=60)
    assert final.result.status == "completed", final.result.error


def test_the_engine_is_not_serving_until_its_model_is_warm(tiny_llama, tmp_path):
    port = free_port()
    env = {
        "EXPERT_MODEL_PATH": str(tiny_llama),
        "EXPERT_ENGINE_PORT": str(port),
        "EXPERT_ENGINE_METRICS_PORT": "0",
        "EXPERT_MAX_MODEL_LEN": "256",
        "EXPERT_KV_NUM_BLOCKS": "32",
        "EXPERT_PREPARATION_TARGET": f"localhost:{free_port()}",
    }  # nobody there: registration just retries

    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "services.engine"],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = health_status(f"localhost:{port}", timeout=0.5)
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.01)
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0
    assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING


def _engine_of(stack, job_id: str) -> str:
    for engine in client_engines(stack):
        if engine.active_jobs:
            return engine.engine_id
    raise AssertionError(f"no engine holds job {job_id}")


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_reception_stopped_gracefully_hands_its_running_jobs_back_and_they_complete(tiny_stack, long_prompt):
    """SIGTERM (a rolling update) with jobs running and no drain: reception exits
    promptly, their engine slots are released, their queue entries stay unacknowledged, and the
    next reception reclaims them and runs them to the end."""
    stack = tiny_stack(EXPERT_RECEPTION_DRAIN_SECONDS="0")  # a job takes about a second here
    with ExpertClient(stack.target("reception")) as client:
        jobs = [long_job(client, long_prompt).job_id for _ in range(8)]
        deadline = time.monotonic() + 60
        while not any(e.active_jobs for e in client_engines(stack)):
            assert time.monotonic() < deadline, "no job was ever placed"
            time.sleep(0.01)
    started = time.monotonic()
    stack.stop_service("reception")
    assert time.monotonic() - started < 10
    assert [e.active_jobs for e in client_engines(stack)] == [0]  # the slots came back
    stack.start_service("reception")
    stack.wait_serving("reception")
    with ExpertClient(stack.target("reception")) as client:
        finals = [wait_final(client, j, timeout=180) for j in jobs]
    assert [f.status for f in finals] == ["completed"] * 8, [f.result.error for f in finals]
    assert any(f.attempts == 2 for f in finals)  # the jobs that were running ran again
    assert [e.active_jobs for e in client_engines(stack)] == [0]


def test_reception_stopped_gracefully_lets_the_jobs_that_end_within_the_drain_answer(tiny_stack, long_prompt):
    """The calls waiting on jobs that end within the drain get their results; nothing is cancelled."""
    stack = tiny_stack(EXPERT_RECEPTION_DRAIN_SECONDS="12")
    options = {"raw": True, "temperature": 0.0, "max_tokens": LONG // 2, "repetition_penalty": 1.0}
    with ExpertClient(stack.target("reception")) as client, ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(client.infer, prompt=long_prompt, **options) for _ in range(3)]
        _wait(lambda: any(e.active_jobs for e in client_engines(stack)))
        stack.stop_service("reception")
        results = [c.result(timeout=30) for c in calls]
    assert [r.status for r in results] == ["completed"] * 3
    assert [e.active_jobs for e in client_engines(stack)] == [0]


def test_after_redis_restarts_empty_reception_is_not_serving_then_recovers_by_itself(tiny_stack):
    """Redis restarted without its data (make run's settings before AOF): while it is down reception
    reports NOT_SERVING; once it is back the queue's groups are created again, reception reports
    SERVING, and later jobs complete and can be cancelled."""
    stack = tiny_stack()
    target = stack.target("reception")
    seen = set()
    # Watch health from the moment Redis dies: the NOT_SERVING window is the outage itself, and
    # reception may already be SERVING again by the time the restart call returns.
    with ThreadPoolExecutor(1) as pool:
        restart = pool.submit(stack.restart_redis, down_s=3.0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = health_status(target)
            seen.add(status)
            if (
                restart.done()
                and health_pb2.HealthCheckResponse.NOT_SERVING in seen
                and status == health_pb2.HealthCheckResponse.SERVING
            ):
                break
            time.sleep(0.1)
        restart.result()
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
    assert health_status(target) == health_pb2.HealthCheckResponse.SERVING
    with ExpertClient(target) as client:
        result = client.infer(prompt="Hello", raw=True, temperature=0.0, max_tokens=8, timeout_ms=60_000)
        assert result.status == "completed", result.error
        job = client.submit(
            prompt="Hello", raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0
        )
        wait_status(client, job.job_id, "running")
        client.cancel(job.job_id)
        assert wait_final(client, job.job_id, timeout=30).status == "cancelled"


def test_a_running_job_whose_owner_is_gone_is_swept_timed_out_with_its_output(tiny_stack, long_prompt):
    """Reception killed with a job placed, and the next reception does not reclaim it (its reclaim
    idle time is long): the sweeper ends the job TIMED_OUT once its deadline and the sweep grace
    pass, with the text it had, and gives its engine slot back."""
    stack = tiny_stack(EXPERT_DISPATCH_SWEEP_GRACE_SECONDS="1")
    with ExpertClient(stack.target("reception")) as client:
        expected = client.infer(
            prompt=long_prompt, raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0
        ).text
        job = long_job(client, long_prompt, timeout_ms=4_000)
        _wait(lambda: any(e.active_jobs for e in client_engines(stack)))
    stack.kill("reception")
    port = free_port()
    stack.ports["reception-2"] = port
    stack.start_service(
        "reception",
        "reception-2",
        {
            "EXPERT_RECEPTION_PORT": str(port),
            "EXPERT_RECEPTION_METRICS_PORT": "0",
            "EXPERT_DISPATCH_RECLAIM_IDLE_MS": "600000",  # only the sweeper can end the job
        },
    )
    stack.wait_serving("reception-2")
    with ExpertClient(stack.target("reception-2")) as client:
        final = wait_final(client, job.job_id, timeout=60)
    assert final.status == "timed_out", final.result.error
    assert "no dispatcher ended it" in final.result.error and final.attempts == 1
    assert expected.startswith(final.result.text)  # the output it had when its owner died
    _wait(lambda: [e.active_jobs for e in client_engines(stack)] == [0], timeout=10)


def test_redis_killed_and_restarted_with_its_aof_mid_batch_loses_no_job(tiny_stack, long_prompt):
    """Redis with the append-only file (as `make run` runs it), killed with 20 jobs queued and
    running and back a second later: every accepted job ends final, none is lost, and CancelJob
    works after the restart (the cancel subscription is renewed)."""
    stack = tiny_stack(redis_durable=True)
    options = {"raw": True, "temperature": 0.0, "repetition_penalty": 1.0, "timeout_ms": 120_000}
    with ExpertClient(stack.target("reception")) as client:
        jobs = [
            client.submit(prompt=long_prompt, max_tokens=LONG if i % 2 else 64, **options).job_id
            for i in range(20)
        ]
        _wait(lambda: any(e.active_jobs for e in client_engines(stack)))
        stack.restart_redis(down_s=1.0)
        finals = [wait_final(client, job_id, timeout=180) for job_id in jobs]
        # each job completes: a running one waits out the outage, or runs again once reclaimed
        assert [f.status for f in finals] == ["completed"] * 20, [(f.status, f.result.error) for f in finals]
        job = long_job(client, long_prompt)
        wait_status(client, job.job_id, "running")
        client.cancel(job.job_id)
        assert wait_final(client, job.job_id, timeout=30).status == "cancelled"
    _wait(lambda: [e.active_jobs for e in client_engines(stack)] == [0], timeout=15)
