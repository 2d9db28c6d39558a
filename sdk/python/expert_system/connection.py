"""Where the clients connect and with what: the reception's address, the API key sent with every
call, the channel options and the quick calls' deadline. `ExpertClient`, `AsyncExpertClient` and the
sessions all read them here (the sessions need the deadline, and so import no client)."""

from __future__ import annotations

import os

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "EXPERT_RECEPTION_TARGET"
API_KEY_ENV = "EXPERT_API_KEY"
# Seconds allowed for the quick calls (submit, get_job, cancel). Infer has no deadline by default:
# the job has its own timeout_ms, after which the server returns the partial output.
DEFAULT_TIMEOUT = 10.0
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
)


def default_target() -> str:
    """The reception's address: EXPERT_RECEPTION_TARGET, else 127.0.0.1:50051."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call sends: `authorization: Bearer <key>` for `api_key`, else for
    EXPERT_API_KEY; nothing without either (a stack with EXPERT_AUTH=off needs none)."""
    key = api_key or os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {key}"),) if key else ()
