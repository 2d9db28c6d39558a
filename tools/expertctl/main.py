"""`expertctl`: the project's command line.

A thin dispatcher: each command lives in its own module, which exposes `register(subparsers)` and
sets a `handler(args) -> int` default on its parser. Errors reach the user as one
`expertctl: error: ...` line, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from tools.expertctl import chat_cmd, client_cmd, expert_cmd, keys_cmd, model_cmd, training_cmd, up_cmd
from tools.expertctl.errors import UsageError

# Registering a command is one more module here.
COMMAND_MODULES = (model_cmd, chat_cmd, expert_cmd, keys_cmd, client_cmd, training_cmd, up_cmd)

PROG = "expertctl"


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as `expertctl: error: ...` on every level (argparse would write
    `expertctl model: error: ...` for a subcommand); subparsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command module registered."""
    parser = _Parser(prog=PROG, description="Operate the Expert System.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `expertctl` with `argv` (default: the process arguments) and return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has already printed the usage error or the help
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        return args.handler(args)
    except UsageError as exc:
        _report(str(exc))
        return 2
    except KeyboardInterrupt:
        _report("interrupted")
        return 130
    except OSError as exc:
        _report(str(exc))
        return 1
    except Exception as exc:  # a runtime failure: one line for the user, not a traceback
        _report(f"{type(exc).__name__}: {exc}")
        return 1


def _report(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
