"""A service process built on libs.grpc_server (tests/helpers/grpc_echo_server.py): SIGTERM stops
it gracefully, and a startup failure exits 1 with one log line and no traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from libs.gen.expert.v1 import router_pb2_grpc
from libs.grpc_client import open_channel
from libs.grpc_server import STOP_MARGIN_S
from tests.helpers.grpc_health import wait_for_serving
from tests.helpers.grpc_services import REPO, json_lines, plan_request
from tests.helpers.ports import free_port


def _echo_server_env(port: int | str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "EXPERT_BIND_HOST": "127.0.0.1",
        "EXPERT_ECHOTEST_PORT": str(port),
        "EXPERT_ECHOTEST_METRICS_PORT": "0",
    }


def test_sigterm_stops_gracefully_and_lets_an_in_flight_call_finish():
    port = free_port()
    target = f"127.0.0.1:{port}"

    async def read_until(process, event: str, seen: list[dict]) -> None:
        while True:
            line = await asyncio.wait_for(process.stdout.readline(), 20)
            assert line, f"the server exited before logging {event!r}: {seen}"
            seen.extend(json_lines(line.decode()))
            if seen and seen[-1]["event"] == event:
                return

    async def scenario():
        pipe = asyncio.subprocess.PIPE
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.helpers.grpc_echo_server",
            cwd=REPO, env=_echo_server_env(port), stdout=pipe, stderr=pipe,
        )  # fmt: skip
        seen: list[dict] = []
        try:
            await wait_for_serving(target, timeout=20)
            async with open_channel(target) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                in_flight = asyncio.ensure_future(stub.Plan(plan_request("slow", "1.0"), timeout=10))
                await read_until(process, "slow plan started", seen)
                process.send_signal(signal.SIGTERM)
                await read_until(process, "server stopping", seen)
                # The line is written just before server.stop() begins; the slow call holds the
                # stop open for most of a second, so a new call a moment later meets a stopping server.
                await asyncio.sleep(0.2)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Plan(plan_request("echo", "late"), timeout=5)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
                assert (await in_flight).plan.prompt_modified == "1.0"
            assert await asyncio.wait_for(process.wait(), 20) == 0
            rest = await process.stdout.read()
            seen.extend(json_lines(rest.decode()))
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        events = [line["event"] for line in seen]
        assert (
            events.index("server started") < events.index("signal received") < events.index("server stopping")
        )
        assert events.index("server stopping") < events.index("on_stop ran") < events.index("server stopped")
        (started,) = [line for line in seen if line["event"] == "server started"]
        assert started["port"] == port and started["service"] == "echotest"

    asyncio.run(scenario())


def _run_echo_server(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.grpc_echo_server"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_port_in_use_exits_1_with_one_log_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = _run_echo_server(_echo_server_env(taken.getsockname()[1]))
    assert result.returncode == 1
    (line,) = json_lines(result.stdout)
    assert line["event"] == "startup failed" and line["level"] == "error"
    assert line["error"].startswith("cannot listen on 127.0.0.1:")
    assert "Traceback" not in result.stdout + result.stderr


def test_a_config_error_exits_1_with_one_log_line():
    result = _run_echo_server(_echo_server_env("not-a-port"))
    assert result.returncode == 1
    (line,) = json_lines(result.stdout)
    assert line["event"] == "startup failed" and line["service"] == "echotest"
    assert line["error"] == "EXPERT_ECHOTEST_PORT: expected an integer, got 'not-a-port'"
    assert "Traceback" not in result.stdout + result.stderr


def test_a_failed_warm_up_stops_the_server_and_exits_1_with_the_traceback_in_one_line():
    result = _run_echo_server({**_echo_server_env(free_port()), "ECHOTEST_FAIL_WARM_UP": "1"})
    assert result.returncode == 1
    lines = json_lines(result.stdout)
    events = [line["event"] for line in lines]
    assert events.index("server stopping") < events.index("on_stop ran") < events.index("service failed")
    assert "RuntimeError: warm-up failed" in lines[events.index("service failed")]["exception"]
    assert "Traceback" not in result.stderr


def test_sigterm_during_a_long_warm_up_stops_at_once():
    env = {**_echo_server_env(free_port()), "ECHOTEST_WARM_UP_SECONDS": "60"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.grpc_echo_server"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in process.stdout:
            if '"warm-up started"' in line:
                break
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert '"server stopped"' in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()


def test_a_stop_that_hangs_ends_the_process_after_its_grace_period():
    """The echo server's grace is 5 s: 5 + STOP_MARGIN_S after SIGTERM the process exits, its
    threads' stacks in the log, though its on_stop would block for a minute."""
    env = {**_echo_server_env(free_port()), "ECHOTEST_STOP_HANG_SECONDS": "60"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.grpc_echo_server"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in process.stdout:
            if '"server started"' in line:
                break
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(timeout=30) == 1
        assert 5.0 + STOP_MARGIN_S - 1 < time.monotonic() - started < 5.0 + STOP_MARGIN_S + 10
        assert '"stop took too long; exiting now"' in process.stdout.read()
        assert "in hard_exit" in process.stderr.read()  # every thread's stack, the hanging one's too
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()
