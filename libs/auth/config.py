"""EXPERT_AUTH and EXPERT_INTERNAL_TOKEN: every service's config embeds an `AuthConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.config import ConfigError, EnvReader

OFF, REQUIRED = "off", "required"
# A token an attacker could guess is no protection: at least this many characters.
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class AuthConfig:
    """`mode` "off": nothing is checked (every call is allowed, as without this feature); "required":
    API keys on the public API, the internal token between services. `internal_token` is what the
    services send each other ("" for none); with auth required it must be set."""

    mode: str = OFF
    internal_token: str = field(default="", repr=False)

    @property
    def required(self) -> bool:
        return self.mode == REQUIRED

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AuthConfig:
        """Reads EXPERT_AUTH (off or required, default off) and EXPERT_INTERNAL_TOKEN."""
        reader = EnvReader(env)
        mode = reader.choice("EXPERT_AUTH", OFF, (OFF, REQUIRED))
        token = reader.text("EXPERT_INTERNAL_TOKEN", "")
        if mode == REQUIRED and not token:
            raise ConfigError(
                "EXPERT_INTERNAL_TOKEN: required with EXPERT_AUTH=required (the services call each other "
                "with it); generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        if token and len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"EXPERT_INTERNAL_TOKEN: must be at least {MIN_TOKEN_CHARS} characters, got {len(token)}"
            )
        return cls(mode=mode, internal_token=token)
