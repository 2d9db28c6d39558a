"""Reading `EXPERT_*` environment variables into validated values, and the server settings every
service embeds in its own frozen config dataclass.

A service's `Config.from_env()` reads each variable once through `EnvReader`; a malformed or
out-of-range value raises `ConfigError` whose message starts with the variable name, so a bad
deployment fails at start-up with one line that says what to fix.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
# host:port where host is a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|[A-Za-z0-9_.-]+)$")
_SERVICE = re.compile(r"^[a-z][a-z0-9_]*$")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message starts with the variable (or field)
    at fault, e.g. `EXPERT_ROUTER_PORT: expected an integer, got 'abc'`."""


class EnvReader:
    """Typed, validated access to environment variables (`os.environ` unless `env` is given, which
    tests use). An unset or blank variable yields the default, which is not validated: defaults are
    the programmer's choice, only operator input is checked."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if env is None else env

    def _raw(self, name: str) -> str | None:
        value = self._env.get(name)
        if value is None or not value.strip():
            return None
        return value.strip()

    def text(self, name: str, default: str) -> str:
        """The stripped value of `name`, or `default` when unset or blank."""
        raw = self._raw(name)
        return default if raw is None else raw

    def integer(
        self, name: str, default: int | None = None, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        """The value of `name` as an integer within [minimum, maximum] (bounds are inclusive); `default`
        (None: unset) when it is unset or blank."""
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
        _check_range(name, value, minimum, maximum)
        return value

    def number(
        self, name: str, default: float, *, minimum: float | None = None, maximum: float | None = None
    ) -> float:
        """The value of `name` as a finite float within [minimum, maximum] (bounds are inclusive)."""
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
        # float() accepts "nan" and "inf", which would slip through every range check.
        if not math.isfinite(value):
            raise ConfigError(f"{name}: expected a finite number, got {raw!r}")
        _check_range(name, value, minimum, maximum)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        """The value of `name` as a boolean: 1/true/yes/on or 0/false/no/off, in any case."""
        raw = self._raw(name)
        if raw is None:
            return default
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}: expected true or false, got {raw!r}")

    def address(self, name: str, default: str) -> str:
        """The value of `name` as a `host:port` address (IPv6 hosts in brackets, port 1-65535)."""
        raw = self._raw(name)
        if raw is None:
            return default
        match = _ADDRESS.match(raw)
        if match is None:
            raise ConfigError(f"{name}: expected host:port, got {raw!r}")
        port = int(match["port"])
        if not 1 <= port <= 65535:
            raise ConfigError(f"{name}: port must be in [1, 65535], got {port}")
        return raw

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        """The lower-cased value of `name`, which must be one of `choices`."""
        value = self.text(name, default).lower()
        if value not in choices:
            raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
        return value


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise ConfigError(f"{name}: must be in [{minimum}, {maximum}], got {value}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}: must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}: must be at most {maximum}, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens and how much it logs: the part of every service's config that
    `libs.grpc_server.serve` needs. `port` 0 lets the OS pick a free port; `metrics_port` 0
    disables the /metrics endpoint."""

    bind_host: str
    port: int
    metrics_port: int
    log_level: str

    @classmethod
    def from_env(
        cls, service: str, default_port: int, default_metrics_port: int, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Reads EXPERT_BIND_HOST (default 0.0.0.0), EXPERT_<SERVICE>_PORT,
        EXPERT_<SERVICE>_METRICS_PORT and EXPERT_LOG_LEVEL (default info)."""
        if not _SERVICE.match(service):
            raise ValueError(f"service name must match {_SERVICE.pattern}, got {service!r}")
        reader = EnvReader(env)
        prefix = f"EXPERT_{service.upper()}"
        bind_host = reader.text("EXPERT_BIND_HOST", "0.0.0.0")
        if not _HOST.match(bind_host):
            raise ConfigError(f"EXPERT_BIND_HOST: expected a host name or address, got {bind_host!r}")
        return cls(
            bind_host=bind_host,
            port=reader.integer(f"{prefix}_PORT", default_port, minimum=0, maximum=65535),
            metrics_port=reader.integer(
                f"{prefix}_METRICS_PORT", default_metrics_port, minimum=0, maximum=65535
            ),
            log_level=reader.choice("EXPERT_LOG_LEVEL", "info", LOG_LEVELS),
        )

    @property
    def bind_address(self) -> str:
        """`bind_host:port` as gRPC expects it (an IPv6 host in brackets)."""
        return f"{bracket_host(self.bind_host)}:{self.port}"


# Where a client on this machine reaches a local server. Never `localhost`: gRPC's resolver (and
# many /etc/hosts) give it ::1 as well as 127.0.0.1, and a process of any user that listens on
# [::1] at a service's port would receive the calls meant for a service bound to 127.0.0.1.
LOOPBACK_HOST = "127.0.0.1"
_WILDCARDS = {"0.0.0.0": LOOPBACK_HOST, "::": "[::1]", "[::]": "[::1]"}


def local_host(bind_host: str) -> str:
    """The host a client on this machine dials for a server bound to `bind_host`, ready to go
    before `:port`: the loopback address of the wildcard's family (0.0.0.0 → 127.0.0.1, :: → [::1]),
    else the bound address itself."""
    return _WILDCARDS.get(bind_host, bracket_host(bind_host))


def bracket_host(host: str) -> str:
    """`host` as it goes before `:port`: IPv6 addresses need brackets, everything else is unchanged."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


# The three files of a service's TLS identity, each named by the setting that gives its path.
TLS_SETTINGS = ("EXPERT_TLS_CA", "EXPERT_TLS_CERT", "EXPERT_TLS_KEY")


@dataclass(frozen=True)
class TlsConfig:
    """A service's identity for mutual TLS between the services, read from PEM files:
    EXPERT_TLS_CA (the CA every service's certificate is signed by: what a peer must present),
    EXPERT_TLS_CERT (this service's certificate, with its names) and EXPERT_TLS_KEY (its private
    key). The files are read once, at start-up: a renewed certificate takes a restart."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The identity the three settings name, or None when none is set; all three or none."""
        reader = EnvReader(env)
        paths = {name: reader.text(name, "") for name in TLS_SETTINGS}
        given = [name for name, path in paths.items() if path]
        if not given:
            return None
        missing = [name for name in TLS_SETTINGS if name not in given]
        if missing:
            raise ConfigError(
                f"{missing[0]}: required with {given[0]} (mutual TLS takes all of {', '.join(TLS_SETTINGS)})"
            )
        ca, cert, key = (_pem(name, paths[name]) for name in TLS_SETTINGS)
        return cls(ca=ca, cert=cert, key=key)


def _pem(name: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{name}: cannot read {path!r}: {error.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{name}: {path!r} is not a PEM file")
    return data
