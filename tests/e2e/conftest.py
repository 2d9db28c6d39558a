"""The whole system for end-to-end tests: a real redis-server and the five real services as processes
(tools.stack), on free ports, with their logs under the test's temporary directory; and one stack
with the trainer worker, shared by the modules that train (`trainer_stack`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from expert_system import ExpertClient
from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import keys_pb2, keys_pb2_grpc, preparation_pb2, preparation_pb2_grpc
from tests.conftest import LONG
from tests.helpers.experts import Publisher
from tools.stack import TRAINER, LocalStack


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


# The internal token of the shared training stack (EXPERT_AUTH=required): what makes its API keys.
TRAINING_TOKEN = "e2e-internal-token-training-0123456789"
TRAINING_DEADLINE_S = 300.0
_FINAL = ("COMPLETED", "FAILED", "CANCELLED")


@dataclass(frozen=True)
class TrainerStack:
    """A stack on the tiny model with EXPERT_AUTH=required and the trainer worker, shared by the
    modules that train. Each module makes API keys of its own, so that it sees only its own files and
    jobs, and names its experts apart from the other modules'; what it leaves running is cancelled
    when it ends (`end_jobs`), so that the next module's jobs do not queue behind it."""

    stack: LocalStack
    store: Path  # the expert store the trainer installs into
    checkpoints: Path  # EXPERT_TRAINER_CHECKPOINT_DIR

    def create_key(self, name: str, scope: int) -> tuple[str, str]:
        """A new API key of `scope`: (its id, the secret to send)."""
        with grpc.insecure_channel(self.stack.target("reception")) as channel:
            response = keys_pb2_grpc.KeyServiceStub(channel).CreateKey(
                keys_pb2.CreateKeyRequest(name=name, scope=scope),
                metadata=credentials_metadata(internal_token=TRAINING_TOKEN),
                timeout=10,
            )
        return response.key.key_id, response.secret

    def trainer_running(self) -> None:
        """Starts the trainer again if a test killed it and did not get to restart it."""
        process = self.stack.processes.get(TRAINER)
        if process is None or process.poll() is not None:
            self.stack.start_service(TRAINER)
            self.stack.wait_serving(TRAINER)

    def end_jobs(self, secret: str) -> None:
        """Cancels the unfinished jobs of the key `secret` and waits until each has ended."""
        headers = {"authorization": f"Bearer {secret}"}
        with httpx.Client(base_url=self.stack.http_url(), headers=headers, timeout=30) as http:
            jobs = http.get("/v1/training/jobs", params={"limit": 100}).json()["data"]
            unfinished = [job["id"] for job in jobs if job["status"] not in _FINAL]
            for job_id in unfinished:
                http.delete(f"/v1/training/jobs/{job_id}")
            deadline = time.monotonic() + TRAINING_DEADLINE_S
            for job_id in unfinished:
                while http.get(f"/v1/training/jobs/{job_id}").json()["status"] not in _FINAL:
                    assert time.monotonic() < deadline, f"job {job_id} never ended after its cancel"
                    time.sleep(0.1)


@pytest.fixture(scope="session")
def trainer_stack(tiny_llama, tmp_path_factory) -> Iterator[TrainerStack]:
    """The one stack with a trainer that test_training_jobs.py, test_fine_tuning_api.py and
    test_training_clients.py share (started once: five services, a trainer and a model load). A
    1.5 s lease, so that a killed trainer's job is taken again within seconds; a checkpoint every 2
    steps unless a job asks otherwise."""
    root = tmp_path_factory.mktemp("trainer-stack")
    publisher = Publisher.create(root / "publisher")
    store, checkpoints = root / "experts", root / "checkpoints"
    settings = {
        **TINY_SETTINGS,
        "EXPERT_AUTH": "required",
        "EXPERT_INTERNAL_TOKEN": TRAINING_TOKEN,
        "EXPERT_STORE": str(store),
        "EXPERT_TRUSTED_KEYS": str(publisher.trusted),
        "EXPERT_TRAINER_SIGNING_KEY": str(publisher.key),
        "EXPERT_TRAINER_CHECKPOINT_DIR": str(checkpoints),
        "EXPERT_TRAINER_CHECKPOINT_STEPS": "2",
        "EXPERT_TRAINER_LEASE_MS": "1500",
        "EXPERT_TRAINER_DEVICE": "cpu",
        "EXPERT_TRAINING_MAX_STEPS": "20000",
        "EXPERT_NUM_THREADS": "1",
    }
    stack = LocalStack.on_free_ports(root / "stack", env=stack_env(tiny_llama, **settings), trainer=True)
    stack.start()
    try:
        wait_ready(stack)
        yield TrainerStack(stack, store, checkpoints)
    finally:
        stack.stop()
