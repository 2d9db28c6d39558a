"""`expertctl keys create|list|revoke`: the API keys of the reception's KeyService.

These calls need an admin key (`--api-key`, $EXPERT_API_KEY) or the internal token
($EXPERT_INTERNAL_TOKEN) in every mode, EXPERT_AUTH=off included; the token is how the first admin
key is made (with auth off, the stack must have been started with the same token):
`EXPERT_INTERNAL_TOKEN=... expertctl keys create --name admin --scope admin`. `create` prints the
key once; only its SHA-256 is stored.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from tools.expertctl.credentials import add_api_key_argument, call_with_credentials

_TIMEOUT = 10.0
_PER_MINUTE = re.compile(r"^(?P<count>[0-9]+)(/min)?$")


def _per_minute(text: str) -> int:
    """`5` or `5/min` -> 5 (0: no limit)."""
    match = _PER_MINUTE.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a count per minute such as 60 or 60/min, got {text!r}")
    return int(match["count"])


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="create, list and revoke API keys", description=__doc__)
    actions = parser.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument("--scope", choices=("infer", "train", "admin"), default="infer", help="default infer")
    create.add_argument(
        "--rate-limit",
        type=_per_minute,
        default=0,
        metavar="R/min",
        help="requests per minute (default: none)",
    )
    create.add_argument(
        "--token-limit",
        type=_per_minute,
        default=0,
        metavar="T/min",
        help="generated tokens per minute (default: none)",
    )
    create.set_defaults(handler=_create)
    listing = actions.add_parser("list", help="every key (never the keys themselves)")
    listing.set_defaults(handler=_list)
    revoke = actions.add_parser("revoke", help="revoke a key: refused from its next call on")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key's id (12 hex digits, as `keys list` shows)")
    revoke.set_defaults(handler=_revoke)
    for action in (create, listing, revoke):
        action.add_argument(
            "--target",
            metavar="HOST:PORT",
            help="the reception (default $EXPERT_RECEPTION_TARGET, else 127.0.0.1:50051)",
        )
        action.add_argument("--json", action="store_true", help="print JSON instead of text")
        add_api_key_argument(action)


_HINTS = {
    "UNAUTHENTICATED": (
        " (send an admin key with --api-key or $EXPERT_API_KEY, or set $EXPERT_INTERNAL_TOKEN)"
    ),
    "PERMISSION_DENIED": " (managing keys needs an admin key)",
}


def _with_keys(handler: Callable[[argparse.Namespace, object], int]) -> Callable[[argparse.Namespace], int]:
    """Open a channel to the reception's KeyService; its errors become one `expertctl: error:` line."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from expert_system.client import default_target
        from libs.gen.expert.v1 import keys_pb2_grpc

        args.target = args.target or default_target()
        return call_with_credentials(
            args,
            args.target,
            keys_pb2_grpc.KeyServiceStub,
            handler,
            refused="refused",
            failed="the reception",
            hints=_HINTS,
        )

    return run


def _time(timestamp) -> str | None:
    if not timestamp.seconds and not timestamp.nanos:
        return None
    return datetime.fromtimestamp(timestamp.seconds + timestamp.nanos / 1e9, UTC).isoformat(
        timespec="seconds"
    )


def _key_dict(key) -> dict:
    from libs.gen.expert.v1 import keys_pb2

    return {
        "key_id": key.key_id,
        "name": key.name,
        "scope": keys_pb2.KeyScope.Name(key.scope).removeprefix("KEY_SCOPE_").lower(),
        "rate_limit": key.rate_limit,
        "token_limit": key.token_limit,
        "created_at": _time(key.created_at),
        "revoked_at": _time(key.revoked_at) if key.HasField("revoked_at") else None,
    }


@_with_keys
def _create(args: argparse.Namespace, keys) -> int:
    from libs.gen.expert.v1 import keys_pb2

    scope = keys_pb2.KeyScope.Value(f"KEY_SCOPE_{args.scope.upper()}")
    request = keys_pb2.CreateKeyRequest(
        name=args.name, scope=scope, rate_limit=args.rate_limit, token_limit=args.token_limit
    )
    response = keys.CreateKey(request, timeout=_TIMEOUT, metadata=args.metadata)
    if args.json:
        print(json.dumps({**_key_dict(response.key), "key": response.secret}, indent=2))
        return 0
    print(response.secret)
    print(
        f"key {response.key.key_id} ({args.scope}) created: store it now, it is not shown again",
        file=sys.stderr,
    )
    return 0


@_with_keys
def _list(args: argparse.Namespace, keys) -> int:
    from libs.gen.expert.v1 import keys_pb2

    listed = [
        _key_dict(key)
        for key in keys.ListKeys(keys_pb2.ListKeysRequest(), timeout=_TIMEOUT, metadata=args.metadata).keys
    ]
    if args.json:
        print(json.dumps(listed, indent=2))
        return 0
    if not listed:
        print("no API keys")
        return 0
    print(f"{'KEY ID':<14}{'SCOPE':<8}{'REQ/MIN':>8}{'TOK/MIN':>10}  {'CREATED':<26}{'REVOKED':<26}NAME")
    for key in listed:
        limits = f"{key['rate_limit'] or '-':>8}{key['token_limit'] or '-':>10}"
        print(
            f"{key['key_id']:<14}{key['scope']:<8}{limits}  "
            f"{key['created_at']:<26}{key['revoked_at'] or '-':<26}{key['name']}"
        )
    return 0


@_with_keys
def _revoke(args: argparse.Namespace, keys) -> int:
    from libs.gen.expert.v1 import keys_pb2

    key = keys.RevokeKey(
        keys_pb2.RevokeKeyRequest(key_id=args.key_id), timeout=_TIMEOUT, metadata=args.metadata
    ).key
    if args.json:
        print(json.dumps(_key_dict(key), indent=2))
    else:
        print(f"key {key.key_id} ({key.name}) revoked")
    return 0
