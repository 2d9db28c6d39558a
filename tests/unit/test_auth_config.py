"""libs.auth.config and the policy's pure parts: EXPERT_AUTH and EXPERT_INTERNAL_TOKEN are read in
one place, a service with auth required refuses to start without a token or a TLS certificate, the
TLS settings come all three or none, and bearer tokens parse."""

from __future__ import annotations

import pytest

from libs.auth.config import AuthConfig
from libs.auth.policy import Access, bearer_token, methods
from libs.config import ConfigError, TlsConfig
from services.engine.config import EngineServiceConfig
from services.reception.config import ReceptionConfig

TOKEN = "0123456789abcdef0123"
PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.fixture
def tls_env(tmp_path) -> dict[str, str]:
    """EXPERT_TLS_* naming three PEM files (contents a service reads, not parses, at start-up)."""
    env = {}
    for name in ("EXPERT_TLS_CA", "EXPERT_TLS_CERT", "EXPERT_TLS_KEY"):
        path = tmp_path / name.lower()
        path.write_bytes(PEM)
        env[name] = str(path)
    return env


def test_auth_is_off_by_default_and_required_needs_the_internal_token(tls_env):
    assert AuthConfig.from_env({}) == AuthConfig(mode="off", internal_token="")
    assert not AuthConfig.from_env({}).required
    config = AuthConfig.from_env({"EXPERT_AUTH": "Required", "EXPERT_INTERNAL_TOKEN": TOKEN, **tls_env})
    assert config.required and config.internal_token == TOKEN
    assert TOKEN not in repr(config)  # a config logged whole does not leak the token
    with pytest.raises(ConfigError, match=r"^EXPERT_INTERNAL_TOKEN: required with EXPERT_AUTH=required"):
        AuthConfig.from_env({"EXPERT_AUTH": "required"})
    with pytest.raises(ConfigError, match=r"^EXPERT_INTERNAL_TOKEN: must be at least 16 characters"):
        AuthConfig.from_env({"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": "short"})
    with pytest.raises(ConfigError, match=r"^EXPERT_AUTH: expected one of off, required, got 'on'"):
        AuthConfig.from_env({"EXPERT_AUTH": "on"})


def test_required_auth_needs_a_certificate_and_tls_takes_all_three_files(tls_env, tmp_path):
    required = {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": TOKEN}
    with pytest.raises(ConfigError, match=r"^EXPERT_TLS_CERT: required with EXPERT_AUTH=required"):
        AuthConfig.from_env(required)
    config = AuthConfig.from_env({**required, **tls_env})
    assert config.tls == TlsConfig(ca=PEM, cert=PEM, key=PEM)
    assert "PRIVATE" not in repr(TlsConfig(ca=PEM, cert=PEM, key=b"PRIVATE KEY"))  # never logged
    # TLS without auth: the services still use it, the token is not needed.
    assert AuthConfig.from_env(tls_env).tls is not None
    with pytest.raises(ConfigError, match=r"^EXPERT_TLS_KEY: required with EXPERT_TLS_CA"):
        AuthConfig.from_env({k: v for k, v in tls_env.items() if k != "EXPERT_TLS_KEY"})
    with pytest.raises(ConfigError, match=r"^EXPERT_TLS_CERT: cannot read '/nonexistent'"):
        AuthConfig.from_env({**tls_env, "EXPERT_TLS_CERT": "/nonexistent"})
    (tmp_path / "garbage").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"^EXPERT_TLS_CA: '.*garbage' is not a PEM file"):
        AuthConfig.from_env({**tls_env, "EXPERT_TLS_CA": str(tmp_path / "garbage")})


def test_every_service_reads_the_same_auth_settings(tls_env):
    env = {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": TOKEN, **tls_env}
    assert (
        ReceptionConfig.from_env(env).auth
        == EngineServiceConfig.from_env(env).auth
        == AuthConfig.from_env(env)
    )
    with pytest.raises(ConfigError, match="EXPERT_INTERNAL_TOKEN"):
        ReceptionConfig.from_env({"EXPERT_AUTH": "required"})


def test_bearer_tokens_and_method_declarations():
    assert bearer_token("Bearer esk_abc") == "esk_abc"
    assert bearer_token("bearer  esk_abc ") == "esk_abc"
    assert bearer_token("Basic dXNlcg==") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None
    assert methods("expert.v1.RouterService", {"Plan": Access.INTERNAL}) == {
        "/expert.v1.RouterService/Plan": Access.INTERNAL
    }
