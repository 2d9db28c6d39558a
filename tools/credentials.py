"""The credentials a tool sends to a stack, from its environment: an API key ($EXPERT_API_KEY unless
one is given) and the internal token ($EXPERT_INTERNAL_TOKEN only: a command line shows in `ps`).
A stack with EXPERT_AUTH=off needs neither."""

from __future__ import annotations

import os

from libs.auth.metadata import credentials_metadata

API_KEY_ENV = "EXPERT_API_KEY"
INTERNAL_TOKEN_ENV = "EXPERT_INTERNAL_TOKEN"


def env_api_key(given: str | None = None) -> str | None:
    """`given`, else $EXPERT_API_KEY; None when neither is set."""
    return given or os.environ.get(API_KEY_ENV) or None


def env_credentials(api_key: str | None = None) -> list[tuple[str, str]]:
    """The metadata for a call: `authorization: Bearer <key>` and the internal token, when set."""
    return credentials_metadata(env_api_key(api_key), os.environ.get(INTERNAL_TOKEN_ENV))
