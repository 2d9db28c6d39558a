"""Reception's HTTP front through its own stop and a Redis outage, on real processes: a graceful
stop answers the calls still waiting (a JSON 503 with Retry-After and the job's id; a stream's
last event says the same) and their jobs complete on the next reception; /readyz and gRPC health
fall and come back together while Redis is away (docs/operations.md#failure-modes)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import redis
from grpc_health.v1 import health_pb2

from libs.gen.expert.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.reception.jobs import job_key
from tests.e2e.conftest import LONG, wait_ready, wait_rest_job
from tools.stack import health_status

FINAL = ("completed", "failed", "cancelled", "timed_out")
CALLS = 6  # non-streamed; the engine runs 4 at once (TINY_SETTINGS), so some are still queued


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _completion(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _streamed_events(url: str, body: dict) -> list[dict]:
    """The data of each server-sent event of a streamed completion, up to the end of the stream."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def _jobs_recorded(store: redis.Redis) -> int:
    """How many job records there are (not counting each job's events, result and text keys)."""
    records = store.scan_iter(match=job_key("*"))
    return sum(1 for key in records if ":" not in key.decode().removeprefix(job_key("")))


def _grpc_infer(target: str, prompt: str) -> grpc.RpcError | None:
    """An Infer call's error (None when it completed)."""
    request = common_pb2.InferenceRequest(
        prompt=prompt, raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0
    )
    with grpc.insecure_channel(target) as channel:
        try:
            inference_pb2_grpc.InferenceServiceStub(channel).Infer(
                inference_pb2.InferRequest(request=request), timeout=120
            )
        except grpc.RpcError as error:
            return error
    return None


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_a_graceful_stop_answers_waiting_http_calls_with_their_job_ids(tiny_stack, long_prompt):
    """SIGTERM with no drain: each non-streamed call still waiting gets a JSON 503 with Retry-After
        and its job's id; the streamed one ends with an error event naming its job; every job then
        completes on the next reception, which the callers follow with GET /v1/jobs/{id}. A gRPC Infer
    caller gets UNAVAILABLE naming its job."""
    stack = tiny_stack(EXPERT_RECEPTION_DRAIN_SECONDS="0")
    wait_ready(stack)
    url = stack.http_url()
    body = {
        "model": _model(url),
        "prompt": long_prompt,
        "max_tokens": LONG,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
    }
    store = redis.Redis.from_url(stack.redis_url)
    with ThreadPoolExecutor(CALLS + 2) as pool:
        calls = [pool.submit(_completion, url, body) for _ in range(CALLS)]
        stream = pool.submit(_streamed_events, url, body)
        grpc_call = pool.submit(_grpc_infer, stack.target("reception"), long_prompt)
        # every call admitted (its job recorded) before the stop
        _wait(lambda: _jobs_recorded(store) == CALLS + 2)
        stack.stop_service("reception")
        answers = [c.result(timeout=60) for c in calls]
        events = stream.result(timeout=60)
        grpc_error = grpc_call.result(timeout=60)
    handed_back = []
    for answer in answers:
        if answer.status_code == 200:  # ended before the stop
            continue
        assert answer.status_code == 503, (answer.status_code, answer.text[:300])
        assert answer.headers["content-type"] == "application/json"
        assert int(answer.headers["Retry-After"]) >= 1
        job_id = answer.json()["expert_system"]["job_id"]
        assert job_id in answer.json()["error"]["message"]
        handed_back.append(job_id)
    assert handed_back, [a.status_code for a in answers]
    last = events[-1]
    assert "error" in last and last["error"]["type"] == "service_unavailable_error", last
    handed_back.append(last["expert_system"]["job_id"])
    # the chunks before it, if any text came, name the same job
    assert all(e["id"] == "cmpl-" + last["expert_system"]["job_id"] for e in events[:-1])
    # a gRPC caller is told the same, as UNAVAILABLE
    assert grpc_error is not None and grpc_error.code() is grpc.StatusCode.UNAVAILABLE, grpc_error
    handed_back.append(re.search(r"job ([0-9a-f]{32}) carries on", grpc_error.details()).group(1))
    stack.start_service("reception")
    stack.wait_serving("reception")
    with httpx.Client(base_url=url, timeout=30) as http:
        for job_id in handed_back:
            job = wait_rest_job(http, job_id, lambda j: j["status"] in FINAL, timeout=180)
            assert job["status"] == "completed", job


def test_readyz_and_grpc_health_fall_and_recover_together_with_redis(tiny_stack):
    """Redis away for 4 s: /readyz answers 503 while gRPC health says NOT_SERVING, and both come
    back after it; each change shows on both probes within a second of the other."""
    stack = tiny_stack()
    wait_ready(stack)
    url, target = stack.http_url(), stack.target("reception")
    ready: list[tuple[float, bool]] = []  # (when it answered, /readyz 200)
    serving: list[tuple[float, bool]] = []  # (when it answered, gRPC SERVING)
    with ThreadPoolExecutor(1) as pool:
        outage = pool.submit(stack.restart_redis, down_s=4.0)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            answer = httpx.get(url + "/readyz", timeout=5).status_code == 200
            ready.append((time.monotonic(), answer))
            status = health_status(target, timeout=5)
            serving.append((time.monotonic(), status == health_pb2.HealthCheckResponse.SERVING))
            if outage.done() and not all(up for _, up in ready) and ready[-1][1] and serving[-1][1]:
                break
            time.sleep(0.05)
        outage.result()
    assert not all(up for _, up in ready), "/readyz never failed while Redis was away"
    assert not all(up for _, up in serving), "gRPC health never said NOT_SERVING while Redis was away"
    assert ready[-1][1] and serving[-1][1], (ready[-3:], serving[-3:])
    (ready_fell, ready_rose), (serving_fell, serving_rose) = _fall_and_rise(ready), _fall_and_rise(serving)
    assert abs(ready_fell - serving_fell) < 1.0, (ready_fell, serving_fell)
    assert abs(ready_rose - serving_rose) < 1.0, (ready_rose, serving_rose)


def _fall_and_rise(answers: list[tuple[float, bool]]) -> tuple[float, float]:
    """When a probe first failed, and when it first succeeded after that."""
    fell = next(when for when, up in answers if not up)
    return fell, next(when for when, up in answers if when > fell and up)


WAITING = 16  # non-streamed calls waiting when the stop begins: 4 run (TINY_SETTINGS), the rest queue
ARRIVING = 6  # callers that keep calling while the stop begins


def _outcome(url: str, body: dict) -> tuple[str, httpx.Response | Exception]:
    """A call's answer, or how it failed without one: ("refused", ...) when no connection was
    made (the server had stopped listening: the call never reached it), ("cut", ...) otherwise."""
    try:
        return "answered", _completion(url, body)
    except httpx.ConnectError as error:
        return "refused", error
    except httpx.TransportError as error:
        return "cut", error


def _keep_calling(
    url: str, body: dict, until: threading.Event
) -> list[tuple[str, httpx.Response | Exception]]:
    """Calls one after another until `until` is set or the server refuses connections."""
    outcomes = []
    while not until.is_set():
        outcomes.append(_outcome(url, body))
        if outcomes[-1][0] == "refused":
            break
    return outcomes


def _recorded_job_ids(store: redis.Redis) -> set[str]:
    prefix = job_key("")
    ids = (key.decode().removeprefix(prefix) for key in store.scan_iter(match=job_key("*")))
    return {job_id for job_id in ids if ":" not in job_id}


def _answered_job_id(answer: httpx.Response) -> str | None:
    """The job a call's answer names: a completion's id, or a handed-back call's 503 in OpenAI's
    shape (JSON, Retry-After, the job's id in the message and in `expert_system`); None for the
    503 of a call the stop cut off before its admission."""
    if answer.status_code == 200:
        return answer.json()["id"].removeprefix("cmpl-")
    assert answer.status_code == 503, (
        answer.status_code,
        answer.headers.get("content-type"),
        answer.text[:300],
    )
    assert answer.headers["content-type"] == "application/json", answer.text[:300]
    assert int(answer.headers["Retry-After"]) >= 1
    body = answer.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    if "expert_system" not in body:
        assert "send it again" in body["error"]["message"], body
        return None
    job_id = body["expert_system"]["job_id"]
    assert job_id in body["error"]["message"], body
    return job_id


@contextlib.contextmanager
def _paused(store: redis.Redis):
    """Redis stopped (SIGSTOP) for the block: every command waits, none fails."""
    pid = store.info("server")["process_id"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stop_answers_every_admitted_http_caller_with_its_job_id_before_the_grace_ends(
    tiny_stack, long_prompt
):
    """SIGTERM with no drain while 16 calls wait and 6 callers keep calling, with Redis paused
    through the stop, so that no call's hand-back can read its job's state in time (what once left
    one caller waiting when uvicorn's grace ran out, answered with a plain-text 500): every call
    with a job is answered naming it (its result, or a JSON 503 with the id), the others with a
    JSON 503 saying to send it again; none gets a 500 or is cut off with its job admitted."""
    stack = tiny_stack(EXPERT_RECEPTION_DRAIN_SECONDS="0")
    wait_ready(stack)
    url = stack.http_url()
    body = {"model": _model(url), "prompt": long_prompt, "max_tokens": LONG, "temperature": 0.0}
    body["repetition_penalty"] = 1.0
    store = redis.Redis.from_url(stack.redis_url)
    stopped = threading.Event()
    with ThreadPoolExecutor(WAITING + ARRIVING) as pool:
        waiting = [pool.submit(_outcome, url, body) for _ in range(WAITING)]
        _wait(lambda: len(_recorded_job_ids(store)) >= WAITING)
        arriving = [pool.submit(_keep_calling, url, body, stopped) for _ in range(ARRIVING)]
        _wait(lambda: len(_recorded_job_ids(store)) >= WAITING + ARRIVING)  # the arrivals are calling
        with _paused(store):
            stack.stop_service("reception")
        stopped.set()
        outcomes = [w.result(timeout=60) for w in waiting]
        outcomes += [o for a in arriving for o in a.result(timeout=60)]
    # A call cut off before it was admitted has no job to name; one admitted and cut would show here.
    answered = {_answered_job_id(answer) for kind, answer in outcomes if kind == "answered"}
    assert _recorded_job_ids(store) <= answered, _recorded_job_ids(store) - answered
