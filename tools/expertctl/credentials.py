"""The credentials `expertctl` sends with its calls: an API key (`--api-key`, else $EXPERT_API_KEY)
and the internal token ($EXPERT_INTERNAL_TOKEN only: a command line shows in `ps`), as
`tools.credentials` reads them. A stack with EXPERT_AUTH=off needs neither. `call_with_credentials`
runs a command's calls with them. The internal services' ports (router, preparation) of a stack
with mutual TLS also ask for a certificate: `internal_channel` presents the one EXPERT_TLS_CA,
EXPERT_TLS_CERT and EXPERT_TLS_KEY name (`client` of `expertctl up`'s data/tls/)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from tools import credentials
from tools.credentials import API_KEY_ENV, INTERNAL_TOKEN_ENV, env_api_key, env_credentials
from tools.expertctl.errors import UsageError


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"the API key to send (default ${API_KEY_ENV}; ${INTERNAL_TOKEN_ENV} is sent too when set)",
    )


def api_key(args: argparse.Namespace) -> str | None:
    return env_api_key(getattr(args, "api_key", None))


def call_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The metadata for a call: `authorization: Bearer <key>` and the internal token, when set."""
    return env_credentials(api_key(args))


def internal_channel(target: str) -> Any:
    """tools.credentials.internal_channel, with incomplete EXPERT_TLS_* settings a usage error."""
    from libs.config import ConfigError

    try:
        return credentials.internal_channel(target)
    except ConfigError as error:
        raise UsageError(str(error)) from None


def call_with_credentials(
    args: argparse.Namespace,
    target: str,
    make_stub: Callable[[Any], Any],
    handler: Callable[[argparse.Namespace, Any], int],
    *,
    refused: str,
    failed: str,
    hints: Mapping[str, str] | None = None,
    internal: bool = False,
) -> int:
    """`handler(args, stub)` over a channel to `target`, with the credentials in `args.metadata`.
    A refusal naming fields becomes a UsageError "`refused`: field: why"; any other error one
    `expertctl: error: <failed> at <target>: <error><hint>` line (hints by status code), exit 1.
    An `internal` target (a service's own port, not reception's) gets `internal_channel`."""
    import grpc

    from expert_system.client import CHANNEL_OPTIONS
    from expert_system.errors import InvalidRequest, error_from_call

    args.metadata = call_metadata(args)
    channel = internal_channel(target) if internal else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    with channel:
        try:
            return handler(args, make_stub(channel))
        except grpc.RpcError as exc:
            error = error_from_call(exc)
    if isinstance(error, InvalidRequest):
        fields = "; ".join(f"{f}: {d}" for f, d in error.field_violations) or error.message
        raise UsageError(f"{refused}: {fields}")
    hint = (hints or {}).get(error.code, "")
    print(f"expertctl: error: {failed} at {target}: {error}{hint}", file=sys.stderr)
    return 1
