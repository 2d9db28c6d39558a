"""The whole system for end-to-end tests: a real redis-server and the five real services as processes
(libs.stack), on free ports, with their logs under the test's temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from expert_system import ExpertClient
from libs.stack import LocalStack


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


@pytest.fixture
def tiny_stack(tiny_llama, tmp_path):
    """A factory of stacks on the tiny model (for tests that kill services); all are stopped after."""
    stacks: list[LocalStack] = []

    def make(**extra: str) -> LocalStack:
        env = stack_env(
            tiny_llama,
            EXPERT_MAX_MODEL_LEN="1024",
            EXPERT_KV_NUM_BLOCKS="160",
            EXPERT_MAX_NUM_SEQS="4",
            **extra,
        )
        stack = LocalStack.on_free_ports(tmp_path / f"stack-{len(stacks)}", env=env)
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
