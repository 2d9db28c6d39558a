"""`expertctl chat`: streams replies from the in-process engine and keeps the conversation."""

from __future__ import annotations

import io
import subprocess
import sys

from libs.engine import LLMEngine, SamplingParams
from tools.expertctl.chat_cmd import Chat
from tools.expertctl.main import main


class _Lines(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_chat_streams_each_reply_and_keeps_the_conversation(tiny_llama):
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=128)
    chat = Chat(engine, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), system="Be brief.")
    out = io.StringIO()
    chat.loop(_Lines("hello there\n\nand again\n/exit\nnever read\n"), out)
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    replies = [m["content"] for m in chat.messages if m["role"] == "assistant"]
    assert out.getvalue() == "".join(r + "\n" for r in replies)
    # the first reply is what the engine gives for the same conversation
    expected = engine.chat(chat.messages[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert replies[0] == expected[0].text
    assert not engine.has_unfinished_requests()


def test_reset_forgets_the_conversation(tiny_llama):
    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=512, num_blocks=128)
    chat = Chat(engine, SamplingParams(temperature=0.0, max_tokens=4))
    chat.loop(_Lines("one\n/reset\ntwo\n"), io.StringIO())
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["two"]


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    assert main(["chat", "--temperature", "3"]) == 2
    assert capsys.readouterr().err.strip() == "expertctl: error: temperature: must be in [0, 2], got 3.0"
    assert main(["chat", "--model", str(tmp_path)]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err


def test_chat_process_answers_from_piped_input(tiny_llama):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.expertctl.main",
            "chat",
            "--model",
            str(tiny_llama),
            "--temperature",
            "0",
            "--max-tokens",
            "5",
            "--max-model-len",
            "256",
        ],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout.strip()) > 0
