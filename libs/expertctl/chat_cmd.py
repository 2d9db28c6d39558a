"""`expertctl chat`: an interactive conversation with a model on the in-process engine.

Tokens are printed as the engine produces them. The conversation is kept and re-sent each turn
(the prefix cache makes the repeated part cheap). `/reset` starts over, `/exit` or Ctrl-D quits,
Ctrl-C stops the current reply.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import TextIO

from libs.expertctl.errors import UsageError

DEFAULT_MODEL_DIR = Path("data/models/SmolLM2-135M-Instruct")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="chat with a model", description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint directory")
    # Other engine settings come from the EXPERT_* environment variables (docs/configuration.md).
    parser.add_argument("--system", help="a system message to start the conversation with")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=4096, help="context window to serve")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from libs.engine import ConfigError, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
    from libs.engine.models.errors import CheckpointError

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
        )
    except InvalidRequestError as exc:
        raise UsageError(str(exc)) from None
    if not (args.model / "config.json").is_file():
        raise UsageError(
            f"--model: {args.model} is not a checkpoint directory (`make model` makes the default)"
        )
    try:
        config = EngineConfig.from_env().with_overrides(
            model=str(args.model), max_model_len=args.max_model_len
        )
        engine = LLMEngine(config)
    except (CheckpointError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    print(
        f"chatting with {args.model.name} ({engine.kernels} kernels). /reset starts over, /exit quits.",
        file=sys.stderr,
    )
    Chat(engine, params, args.system).loop(sys.stdin, sys.stdout)
    return 0


class Chat:
    """The read-eval-print loop, separated from argument parsing so that tests can drive it."""

    def __init__(self, engine, params, system: str | None = None) -> None:
        from libs.engine import OutputKind

        self.engine = engine
        self.params = params
        self.params.output_kind = OutputKind.DELTA
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def loop(self, stdin: TextIO, stdout: TextIO) -> None:
        while True:
            if stdin.isatty():
                stdout.write("you> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                return
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                return
            if text == "/reset":
                self.reset()
                continue
            self.messages.append({"role": "user", "content": text})
            reply = self.reply(stdout)
            self.messages.append({"role": "assistant", "content": reply})

    def reply(self, stdout: TextIO) -> str:
        """Stream one assistant reply to `stdout` and return its text."""
        from libs.engine import InvalidRequestError

        request_id = f"chat-{next(self._ids)}"
        try:
            self.engine.add_request(request_id, self.messages, self.params)
        except InvalidRequestError as exc:
            self.messages.pop()
            stdout.write(f"[{exc}]\n")
            return ""
        pieces: list[str] = []
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    delta = output.outputs[0].text
                    pieces.append(delta)
                    stdout.write(delta)
                    stdout.flush()
        except KeyboardInterrupt:
            self.engine.abort_request(request_id)
            self.engine.step()
            stdout.write(" [stopped]")
        stdout.write("\n")
        stdout.flush()
        return "".join(pieces)
