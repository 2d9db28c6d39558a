"""EXPERT_AUTH, EXPERT_INTERNAL_TOKEN and the mutual-TLS identity (EXPERT_TLS_*): every service's
config embeds an `AuthConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.config import ConfigError, EnvReader, TlsConfig

OFF, REQUIRED = "off", "required"
# A token an attacker could guess is no protection: at least this many characters.
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class AuthConfig:
    """`mode` "off": nothing is checked (every call is allowed, as without this feature); "required":
    API keys on the public API, the internal token between services. `internal_token` is what the
    services send each other ("" for none); with auth required it must be set. `tls` is the
    service's certificate for mutual TLS with the other services (None: plaintext); with auth
    required it must be set too, so that the token only ever travels inside authenticated channels
    and only a holder of a certificate from the CA can call (or pose as) an internal service."""

    mode: str = OFF
    internal_token: str = field(default="", repr=False)
    tls: TlsConfig | None = None

    @property
    def required(self) -> bool:
        return self.mode == REQUIRED

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, launcher_makes_tls: bool = False
    ) -> AuthConfig:
        """Reads EXPERT_AUTH (off or required, default off), EXPERT_INTERNAL_TOKEN and EXPERT_TLS_CA,
        EXPERT_TLS_CERT and EXPERT_TLS_KEY (libs.config.TlsConfig). `launcher_makes_tls`: a launcher
        that makes the certificates itself (tools.stack) checks the rest before it does."""
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
        tls = TlsConfig.from_env(env)
        if mode == REQUIRED and tls is None and not launcher_makes_tls:
            raise ConfigError(
                "EXPERT_TLS_CERT: required with EXPERT_AUTH=required (the services authenticate each other "
                "with mutual TLS): set EXPERT_TLS_CA, EXPERT_TLS_CERT and EXPERT_TLS_KEY, or start the "
                "stack with `expertctl up`, which makes them (docs/operations.md#security)"
            )
        return cls(mode=mode, internal_token=token, tls=tls)
