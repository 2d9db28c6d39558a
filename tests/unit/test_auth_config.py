"""libs.auth.config and the policy's pure parts: EXPERT_AUTH and EXPERT_INTERNAL_TOKEN are read in
one place, a service with auth required refuses to start without a token, and bearer tokens parse."""

from __future__ import annotations

import pytest

from libs.auth.config import AuthConfig
from libs.auth.policy import Access, bearer_token, methods
from libs.config import ConfigError
from services.engine.config import EngineServiceConfig
from services.reception.config import ReceptionConfig

TOKEN = "0123456789abcdef0123"


def test_auth_is_off_by_default_and_required_needs_the_internal_token():
    assert AuthConfig.from_env({}) == AuthConfig(mode="off", internal_token="")
    assert not AuthConfig.from_env({}).required
    config = AuthConfig.from_env({"EXPERT_AUTH": "Required", "EXPERT_INTERNAL_TOKEN": TOKEN})
    assert config.required and config.internal_token == TOKEN
    assert TOKEN not in repr(config)  # a config logged whole does not leak the token
    with pytest.raises(ConfigError, match=r"^EXPERT_INTERNAL_TOKEN: required with EXPERT_AUTH=required"):
        AuthConfig.from_env({"EXPERT_AUTH": "required"})
    with pytest.raises(ConfigError, match=r"^EXPERT_INTERNAL_TOKEN: must be at least 16 characters"):
        AuthConfig.from_env({"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": "short"})
    with pytest.raises(ConfigError, match=r"^EXPERT_AUTH: expected one of off, required, got 'on'"):
        AuthConfig.from_env({"EXPERT_AUTH": "on"})


def test_every_service_reads_the_same_auth_settings():
    env = {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": TOKEN}
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
