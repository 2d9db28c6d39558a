"""`expertctl chat --target`: the chat through a session on a real stack on the tiny model; each line
a turn, `/reset` a new session, Ctrl-C a cancelled reply, and failures as one-line errors."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import grpc
import pytest

from expert_system import ExpertClient
from libs.gen.expert.v1 import session_pb2, session_pb2_grpc
from tests.helpers.ports import free_port
from tools.expertctl.chat_cmd import RemoteChat
from tools.expertctl.main import main

SETTINGS = ["--temperature", "0", "--max-tokens", "8", "--system", "Be brief."]


@pytest.fixture(scope="module")
def stack(shared_tiny_stack):
    return shared_tiny_stack  # it only sends requests: the session's shared stack serves


@pytest.fixture(scope="module")
def target(stack) -> str:
    return stack.target("reception")


class _Lines(io.StringIO):
    def isatty(self) -> bool:
        return False


class _InterruptedOnce(io.StringIO):
    """A terminal whose user presses Ctrl-C as the first reply's text arrives."""

    armed = True

    def write(self, text: str) -> int:
        if self.armed and text:
            self.armed = False
            raise KeyboardInterrupt
        return super().write(text)


def _reply(target: str, text: str) -> str:
    """What a session with the chat's settings answers to `text`."""
    with (
        ExpertClient(target) as client,
        client.session(system_prompt="Be brief.", temperature=0.0, max_new_tokens=8) as session,
    ):
        session.append(text)
        stream = session.generate()
        list(stream)
        return stream.end.text


def _gone(target: str, session_id: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = session_pb2_grpc.SessionServiceStub(channel)
        try:
            stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id))
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND
    return False


def test_the_chat_process_answers_each_line_through_a_session(target):
    result = subprocess.run(
        [sys.executable, "-m", "tools.expertctl.main", "chat", "--target", target, *SETTINGS],
        input="hello\nbad \x00 line\n/reset\nagain\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # Each reply is what a session with the same settings answers; /reset started a new session.
    assert result.stdout == _reply(target, "hello") + "\n" + _reply(target, "again") + "\n"
    errors = [line for line in result.stderr.splitlines() if line.startswith("expertctl: error:")]
    assert errors == ["expertctl: error: text[0].content: must not contain NUL bytes"]
    sessions = re.findall(r"session:? ([0-9a-f]{32})", result.stderr)
    assert len(set(sessions)) == 2, result.stderr
    assert all(_gone(target, session_id) for session_id in sessions)  # both were ended


def test_ctrl_c_cancels_the_reply_and_the_next_line_is_answered(target, capsys):
    class Recorded(RemoteChat):
        """Keeps the session's last state, and what each cancel returned."""

        def start(self) -> None:
            super().start()
            cancel = self.session.cancel
            self.session.cancel = lambda **kw: self.cancels.append(cancel(**kw)) or self.cancels[-1]

        def end(self) -> None:
            if self.session is not None:
                self.last = self.session.info()
            super().end()

    with ExpertClient(target) as client:
        chat = Recorded(client, {"temperature": 0.0, "max_new_tokens": 200})
        chat.cancels = []
        chat.start()
        session_id = chat.session_id
        out = _InterruptedOnce()
        chat.loop(_Lines("tell me a long story\nand now?\n"), out)
    assert "expertctl: error" not in capsys.readouterr().err  # the cancelled turn settled in time
    assert out.getvalue().startswith(" [stopped]\n") and out.getvalue().endswith("\n")
    # Ctrl-C cancelled once. Dropping the call already stops the turn on the server (a client that
    # hangs up cancels its job), so the explicit cancel may find it stopped (False) or stop it (True).
    assert len(chat.cancels) == 1
    assert chat.last.turns == 2 and chat.last.state == "idle"
    assert _gone(target, session_id)


def test_an_unreachable_target_and_bad_settings_are_one_line_errors(target, capsys):
    unreachable = f"127.0.0.1:{free_port()}"
    assert main(["chat", "--target", unreachable]) == 1
    err = capsys.readouterr().err
    assert (
        err == f"expertctl: error: cannot reach reception at {unreachable} (is the stack running? make run)\n"
    )
    assert main(["chat", "--target", target, "--temperature", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("expertctl: error: sampling.temperature: ") and err.count("\n") == 1
    assert main(["chat", "--target", target, "--seed", "-1"]) == 2
    assert capsys.readouterr().err.startswith("expertctl: error: seed: ")
    assert main(["chat", "--target", target, "--max-model-len", "512"]) == 2
    assert "not with --target" in capsys.readouterr().err
