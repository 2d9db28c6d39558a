"""The credentials `expertctl` sends with its calls: an API key (`--api-key`, else $EXPERT_API_KEY)
and the internal token ($EXPERT_INTERNAL_TOKEN only: a command line shows in `ps`). A stack with
EXPERT_AUTH=off needs neither."""

from __future__ import annotations

import argparse
import os

from libs.auth.metadata import credentials_metadata

API_KEY_ENV = "EXPERT_API_KEY"
INTERNAL_TOKEN_ENV = "EXPERT_INTERNAL_TOKEN"


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"the API key to send (default ${API_KEY_ENV}; ${INTERNAL_TOKEN_ENV} is sent too when set)",
    )


def api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


def call_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The metadata for a call: `authorization: Bearer <key>` and the internal token, when set."""
    return credentials_metadata(api_key(args), os.environ.get(INTERNAL_TOKEN_ENV))
