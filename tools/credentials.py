"""The credentials a tool sends to a stack, from its environment: an API key ($EXPERT_API_KEY unless
one is given) and the internal token ($EXPERT_INTERNAL_TOKEN only: a command line shows in `ps`).
A stack with EXPERT_AUTH=off needs neither. The internal services' ports of a stack with mutual
TLS also ask for a certificate: `internal_channel` presents the one EXPERT_TLS_CA, EXPERT_TLS_CERT
and EXPERT_TLS_KEY name (`client` in `expertctl up`'s data/tls/)."""

from __future__ import annotations

import os
from typing import Any

from libs.auth.metadata import credentials_metadata

API_KEY_ENV = "EXPERT_API_KEY"
INTERNAL_TOKEN_ENV = "EXPERT_INTERNAL_TOKEN"


def env_api_key(given: str | None = None) -> str | None:
    """`given`, else $EXPERT_API_KEY; None when neither is set."""
    return given or os.environ.get(API_KEY_ENV) or None


def env_credentials(api_key: str | None = None) -> list[tuple[str, str]]:
    """The metadata for a call: `authorization: Bearer <key>` and the internal token, when set."""
    return credentials_metadata(env_api_key(api_key), os.environ.get(INTERNAL_TOKEN_ENV))


def internal_channel(target: str) -> Any:
    """A blocking channel to an internal service's port (router, preparation): mutual TLS with the
    certificate the EXPERT_TLS_* variables name, plaintext when none is set. Raises
    libs.config.ConfigError, naming the variable, when they are incomplete or unreadable."""
    import grpc

    from expert_system.client import CHANNEL_OPTIONS
    from libs.config import TlsConfig
    from libs.tls import channel_credentials

    tls = TlsConfig.from_env()
    if tls is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(target, channel_credentials(tls), options=CHANNEL_OPTIONS)
