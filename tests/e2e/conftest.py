"""The whole system for end-to-end tests: a real redis-server and the five real services as processes
(tools.stack), on free ports, with their logs under the test's temporary directory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from expert_system import ExpertClient
from libs.gen.expert.v1 import preparation_pb2, preparation_pb2_grpc
from tests.conftest import LONG
from tools.stack import LocalStack


def stack_env(model: Path, **extra: str) -> dict[str, str]:
    return {
        "EXPERT_MODEL_PATH": str(model),
        "EXPERT_NUM_THREADS": "2",
        "EXPERT_PREPARATION_HEARTBEAT_SECONDS": "0.5",
        "EXPERT_DISPATCH_RECLAIM_IDLE_MS": "1500",
        "EXPERT_LOG_LEVEL": "info",
        **extra,
    }


@pytest.fixture(scope="module")
def stack(default_model, tmp_path_factory) -> LocalStack:
    """The default model behind the pipeline; one engine slot, so that jobs queue behind each other."""
    env = stack_env(
        default_model, EXPERT_MAX_MODEL_LEN="1024", EXPERT_KV_NUM_BLOCKS="192", EXPERT_MAX_NUM_SEQS="1"
    )
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("stack"), env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> ExpertClient:
    with ExpertClient(stack.target("reception")) as client:
        yield client


# What every stack on the tiny model runs with.
TINY_SETTINGS = {"EXPERT_MAX_MODEL_LEN": "1024", "EXPERT_KV_NUM_BLOCKS": "160", "EXPERT_MAX_NUM_SEQS": "4"}


@contextlib.contextmanager
def ready_tiny_stack(model: Path, root: Path, **extra: str) -> Iterator[LocalStack]:
    """A stack on the tiny `model` under `root`, once its HTTP front reports ready; stopped after."""
    stack = LocalStack.on_free_ports(root, env=stack_env(model, **(TINY_SETTINGS | extra)))
    stack.start()
    try:
        wait_ready(stack)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def tiny_stack(tiny_llama, tmp_path):
    """A factory of stacks on the tiny model (for tests that kill services); all are stopped after."""
    stacks: list[LocalStack] = []

    def make(*, redis_durable: bool = False, **extra: str) -> LocalStack:
        env = stack_env(tiny_llama, **TINY_SETTINGS, **extra)
        stack = LocalStack.on_free_ports(
            tmp_path / f"stack-{len(stacks)}", env=env, redis_durable=redis_durable
        )
        stacks.append(stack)
        stack.start()
        return stack

    yield make
    for stack in stacks:
        stack.stop()


@pytest.fixture(autouse=True)
def services_stay_alive(request):
    """After each test on the shared stack, every service is still running: a crash shows here, at
    the test that caused it, rather than as a refused connection in a later one."""
    yield
    if "stack" in request.fixturenames:
        stack: LocalStack = request.getfixturevalue("stack")
        dead = {name: p.returncode for name, p in stack.processes.items() if p.poll() is not None}
        assert not dead, f"services exited (status): {dead}; logs in {stack.log_dir}"


def long_job(client: ExpertClient, prompt: str, **fields):
    """Submit `prompt` to run LONG greedy tokens (with `long_prompt`, it runs them all)."""
    return client.submit(
        prompt=prompt, raw=True, temperature=0.0, max_tokens=LONG, repetition_penalty=1.0, **fields
    )


def client_engines(stack) -> list:
    with grpc.insecure_channel(stack.target("preparation")) as channel:
        stub = preparation_pb2_grpc.PreparationServiceStub(channel)
        return list(stub.ListEngines(preparation_pb2.ListEnginesRequest()).engines)


def wait_ready(stack: LocalStack, timeout: float = 60.0) -> None:
    """Until reception's HTTP /readyz answers 200 (an engine is registered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(stack.http_url() + "/readyz", timeout=5).status_code == 200:
            return
        time.sleep(0.2)
    pytest.fail("reception's /readyz never answered 200")


def wait_rest_job(http: httpx.Client, job_id: str, done, timeout: float = 30.0) -> dict:
    """The job from GET /v1/jobs/{id} once `done(job)`."""
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if done(job):
            return job
        time.sleep(0.02)
    pytest.fail(f"job {job_id} never got there: {job}")


def openai_client(stack: LocalStack, api_key: str = "anything") -> openai.OpenAI:
    """The real `openai` client on the stack's HTTP front, no retries; `api_key` matters only on a
    stack with EXPERT_AUTH=required (any value passes with auth off)."""
    return openai.OpenAI(base_url=stack.http_url() + "/v1", api_key=api_key, max_retries=0)
