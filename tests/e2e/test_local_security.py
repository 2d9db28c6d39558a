"""What another local user's process can reach of a stack on this machine (tools.stack, as `make
run` starts it): nothing of the internal traffic through the IPv6 loopback, and nothing of Redis
without its password, neither over the network nor in its files."""

from __future__ import annotations

import socket
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import redis

from expert_system import ExpertClient
from tests.e2e.conftest import TINY_SETTINGS, stack_env, wait_ready
from tests.helpers.rogue_listener import RogueListeners, ipv6_loopback_available
from tools.stack import LocalStack

JOBS = 20


@pytest.fixture(scope="module")
def watched_stack(tiny_llama, tmp_path_factory):
    """A stack as `make run` starts it (durable Redis), with a rogue listener on [::1] at each of
    its service ports from before it starts (None without an IPv6 loopback)."""
    stack = LocalStack.on_free_ports(
        tmp_path_factory.mktemp("stack"), env=stack_env(tiny_llama, **TINY_SETTINGS), redis_durable=True
    )
    rogue = None
    if ipv6_loopback_available():
        rogue = RogueListeners([*stack.ports.values(), *stack.http_ports.values()])
    try:
        stack.start()
        wait_ready(stack)
        yield stack, rogue
    finally:
        stack.stop()
        if rogue is not None:
            rogue.close()


def test_a_listener_on_the_ipv6_loopback_at_the_services_ports_receives_nothing(watched_stack, tiny_llama):
    """The services listen on 127.0.0.1; were any target `localhost`, gRPC would also dial ::1,
    where another user's process could listen at the same port and be handed the internal token,
    the prompts and the API keys."""
    stack, rogue = watched_stack
    if rogue is None:
        pytest.skip("this machine has no IPv6 loopback (::1), so nothing can listen there")
    with ExpertClient(stack.target("reception")) as client, ThreadPoolExecutor(JOBS) as pool:
        grpc_jobs = [
            pool.submit(client.infer, prompt=f"Hello {n}", temperature=0.0, max_tokens=8) for n in range(JOBS)
        ]
        http_job = pool.submit(
            httpx.post,
            stack.http_url() + "/v1/completions",
            json={"model": tiny_llama.name, "prompt": "Hello", "max_tokens": 4},
            timeout=300,
        )
        results = [job.result(timeout=300) for job in grpc_jobs]
        answer = http_job.result(timeout=300)
    assert [r.status for r in results] == ["completed"] * JOBS, [r.error for r in results]
    assert answer.status_code == 200, answer.text
    assert rogue.connections() == {}, f"the rogue listener was dialled: {rogue.received}"


def test_the_launchers_redis_refuses_a_client_without_its_password(watched_stack):
    stack, _ = watched_stack
    url = urlparse(stack.redis_url)
    assert url.hostname == "127.0.0.1" and url.password
    with socket.create_connection(("127.0.0.1", url.port), timeout=5) as conn:
        conn.sendall(b"KEYS *\r\n")
        assert conn.recv(64).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=url.port, password="guess").ping()
    assert redis.Redis.from_url(stack.redis_url).ping()  # what the services use


def test_the_launchers_redis_files_are_the_owners_only(watched_stack):
    stack, _ = watched_stack
    with ExpertClient(stack.target("reception")) as client:
        assert client.infer(prompt="Hello", temperature=0.0, max_tokens=4).status == "completed"
    directory = stack.log_dir / "redis"
    files = [path for path in directory.rglob("*") if path.is_file()]
    assert any(path.name.endswith(".aof") for path in files), files  # the job's record is on disk
    for path in [directory, *directory.rglob("*")]:
        expected = 0o700 if path.is_dir() else 0o600
        assert _mode(path) == expected, f"{path} is {oct(_mode(path))}"
    assert (directory / "password").read_text().strip() == urlparse(stack.redis_url).password


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)
