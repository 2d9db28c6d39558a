"""`expertctl chat`: an interactive conversation with a model on the in-process engine, or, with
`--target HOST:PORT`, through a session on the running stack's reception (docs/api.md#sessions).

Tokens are printed as they are produced. In process, the conversation is kept and re-sent each turn
(the prefix cache makes the repeated part cheap); through a session, each line is appended to the
session and only the new tokens are computed. `/reset` starts over, `/exit` or Ctrl-D quits, Ctrl-C
stops the current reply (with --target, `/continue` goes on with a reply that was cut).

With --target and `--tools FILE`, every turn offers the tools (`--tool-choice`); a reply that calls
them prints each call on a line, `[tool call <id>] <name> <arguments>`, and `/result TEXT` answers
the first call not yet answered (a tool message), then the model replies once every call has its
result.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tools.expertctl.client_cmd import add_tool_arguments, format_call, tool_fields
from tools.expertctl.credentials import add_api_key_argument, api_key
from tools.expertctl.errors import UsageError

if TYPE_CHECKING:
    from expert_system import ExpertClient, Session

DEFAULT_MODEL_DIR = Path("data/models/SmolLM2-135M-Instruct")
# The in-process engine's settings when not given (with --target, what is not given is not sent:
# the session's router decides it).
IN_PROCESS_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 512, "max_model_len": 4096}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="chat with a model", description=__doc__)
    parser.add_argument(
        "--model",
        type=Path,
        help=f"checkpoint directory (default {DEFAULT_MODEL_DIR}); with --target, the base model's "
        "name in the fleet (default: the fleet's)",
    )
    parser.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="chat through a session on the reception at HOST:PORT instead of an in-process engine",
    )
    add_api_key_argument(parser)
    # Other engine settings come from the EXPERT_* environment variables (docs/configuration.md).
    parser.add_argument("--system", help="a system message to start the conversation with")
    parser.add_argument("--temperature", type=float, help="default 0.7 (with --target: the router's)")
    parser.add_argument("--top-p", type=float, help="default 0.95 (with --target: the router's)")
    parser.add_argument(
        "--max-tokens", type=int, help="a reply's most tokens; default 512 (with --target: the router's)"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--max-model-len", type=int, help="context window to serve (default 4096; not with --target)"
    )
    # Each turn offers the tools (with --target); `/result TEXT` answers the reply's next call.
    add_tool_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.target is not None:
        if args.max_model_len is not None:
            raise UsageError("--max-model-len: the in-process engine's setting; not with --target")
        return _run_remote(args)
    if args.tools is not None:
        raise UsageError("--tools: tools are offered through a session; give --target")
    from libs.engine import ConfigError, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
    from libs.engine.models.errors import CheckpointError

    for name, default in IN_PROCESS_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.model is None:
        args.model = DEFAULT_MODEL_DIR
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
        for text in _lines(stdin, stdout):
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


def _lines(stdin: TextIO, stdout: TextIO) -> Iterator[str]:
    """The user's non-empty lines, stripped, until end of input or `/exit` (prompting on a tty)."""
    while True:
        if stdin.isatty():
            stdout.write("you> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            return
        text = line.strip()
        if text == "/exit":
            return
        if text:
            yield text


def _run_remote(args: argparse.Namespace) -> int:
    from tools.expertctl.client_cmd import _reporting_errors

    args.service = "reception"  # how _reporting_errors names what it cannot reach
    return _reporting_errors(_chat_remote)(args)


def _chat_remote(args: argparse.Namespace) -> int:
    """The chat through one session at `args.target`; failing to open the first session raises
    (for `_reporting_errors`), later failures are reported line by line."""
    from expert_system import ExpertClient

    settings = {
        "system_prompt": args.system,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_tokens,
        "seed": args.seed,
        "model": None if args.model is None else str(args.model),
    }
    turn = tool_fields(args)
    with ExpertClient(args.target, api_key=api_key(args)) as client:
        chat = RemoteChat(client, {k: v for k, v in settings.items() if v is not None}, turn)
        try:
            chat.start()
        except (TypeError, ValueError) as exc:  # a value the request cannot hold, e.g. a negative seed
            raise UsageError(str(exc)) from None
        print(
            f"chatting through session {chat.session_id} at {args.target}. /reset starts over, "
            "/continue goes on with a cut reply, /exit quits.",
            file=sys.stderr,
        )
        chat.loop(sys.stdin, sys.stdout)
    return 0


class RemoteChat:
    """The read-eval-print loop of `chat --target`: one session on the reception, each input line
    appended to it and the reply streamed. A failed call is reported on one line and the loop goes
    on; the session is ended when the loop ends."""

    def __init__(self, client: ExpertClient, settings: dict, turn: dict | None = None) -> None:
        self.client = client
        self.settings = settings
        # Each turn's fields (the tools), and the calls of the last reply not yet answered.
        self.turn = turn or {}
        self.unanswered: list = []
        self.session: Session | None = None

    @property
    def session_id(self) -> str:
        return self.session.session_id if self.session is not None else ""

    def start(self) -> None:
        self.session = self.client.session(**self.settings)

    def end(self) -> None:
        """End the session (quietly: one that cannot be ended expires on its own)."""
        from expert_system import ExpertSystemError

        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(ExpertSystemError):
                session.end()

    def reset(self) -> None:
        self.end()
        self.start()
        _notice(f"[a new session: {self.session_id}]")

    def loop(self, stdin: TextIO, stdout: TextIO) -> None:
        from expert_system import ExpertSystemError

        try:
            for text in _lines(stdin, stdout):
                try:
                    if text == "/reset":
                        self.reset()
                    elif text == "/continue":
                        self._ensure_session()
                        self.reply(stdout)
                    elif text == "/result" or text.startswith("/result "):
                        self.answer_call(text.removeprefix("/result").strip(), stdout)
                    else:
                        self.say(text, stdout)
                except ExpertSystemError as exc:
                    _error(_describe(exc, self.client.target))
        finally:
            self.end()

    def _ensure_session(self) -> None:
        if self.session is None:  # a /reset failed to open the next one
            self.start()

    def say(self, text: str, stdout: TextIO) -> str:
        """Append `text` as the next user message and stream the reply."""
        from expert_system import NotFound

        self._ensure_session()
        assert self.session is not None
        try:
            self.session.append(text)
        except NotFound:  # it expired (EXPERT_SESSION_IDLE_SECONDS) or was ended elsewhere
            _notice("[the session is gone (expired or ended): a new one starts, without the conversation]")
            self.session = None
            self.start()
            self.session.append(text)
        return self.reply(stdout)

    def answer_call(self, result: str, stdout: TextIO) -> None:
        """Append `result` as the tool message of the first unanswered call; once every call of
        the reply has its result, stream the next reply."""
        if not self.unanswered:
            _error("/result: no tool call waits for a result")
            return
        if not result:
            _error("/result: give the call's result, e.g. /result 21 degrees")
            return
        assert self.session is not None
        call = self.unanswered[0]
        self.session.append([{"role": "tool", "tool_call_id": call.id, "content": result}])
        self.unanswered.pop(0)
        if not self.unanswered:
            self.reply(stdout)

    def reply(self, stdout: TextIO) -> str:
        """Stream the session's next reply to `stdout` and return its text; Ctrl-C cancels it
        (the session keeps what was generated). A reply of tool calls prints the calls instead."""
        from expert_system import ExpertSystemError

        assert self.session is not None
        self.unanswered = []
        stream = self.session.generate(**self.turn)
        # With tools, a reply may be calls: it is printed once it ended, as its text or its calls.
        live = "tools" not in self.turn
        printed = ""
        try:
            for chunk in stream:
                if chunk.restarted:
                    if printed and live:
                        stdout.write("\n")
                    printed = ""
                    _notice(f"[the reply restarted (attempt {chunk.attempt}): its text starts over]")
                    continue
                printed += chunk.text
                if live:
                    stdout.write(chunk.text)
                    stdout.flush()
        except KeyboardInterrupt:
            stream.cancel()
            stdout.write(" [stopped]\n")
            stdout.flush()
            self.session.cancel()  # the turn settles, keeping its text, before the next line
            return printed
        except ExpertSystemError:
            if printed and live:
                stdout.write("\n")
                stdout.flush()
            raise
        return self._ended(stream.end, printed, live, stdout)

    def _ended(self, end, printed: str, live: bool, stdout: TextIO) -> str:
        """Finish the reply's output (its calls, or its text unless it was printed `live`), say how
        it ended, and return what was printed."""
        if end is not None and end.tool_calls:
            self.unanswered = list(end.tool_calls)
            printed = "\n".join(format_call(call) for call in end.tool_calls)
            _notice("[answer each call with /result TEXT]")
        stdout.write("\n" if live else printed + "\n")
        stdout.flush()
        if end is not None and end.error:
            _error(f"the reply ended early ({end.finish_reason}): {end.error}")
        elif end is not None and end.finish_reason == "length":
            _notice("[the reply was cut at its token limit: /continue goes on]")
        return printed


def _describe(error, target: str) -> str:
    """One line for a failed call."""
    from tools.expertctl.client_cmd import _UNREACHABLE_HINTS

    if error.code == "UNAVAILABLE" and any(h in error.message.lower() for h in _UNREACHABLE_HINTS):
        return f"cannot reach reception at {target} (is the stack running? make run)"
    if error.field_violations:
        return "; ".join(f"{field}: {description}" for field, description in error.field_violations)
    return error.message or error.code


def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _error(message: str) -> None:
    print(f"expertctl: error: {message}", file=sys.stderr, flush=True)
