"""EnvReader and ServerConfig: values parse, defaults fill in for unset or blank variables, and every
malformed or out-of-range value is refused with a message that starts with the variable name."""

from __future__ import annotations

import pytest

from libs.config import ConfigError, EnvReader, ServerConfig, local_host


def test_unset_and_blank_variables_give_the_default():
    reader = EnvReader({"BLANK": "  "})
    assert reader.text("MISSING", "d") == "d"
    assert reader.text("BLANK", "d") == "d"
    assert reader.integer("BLANK", 7) == 7
    assert reader.number("MISSING", 0.5) == 0.5
    assert reader.boolean("MISSING", True) is True
    assert reader.address("MISSING", "localhost:1") == "localhost:1"


def test_values_are_parsed_and_stripped():
    reader = EnvReader({"T": " text ", "I": " 42 ", "N": "2.5", "A": "router:50052", "V6": "[::1]:80"})
    assert reader.text("T", "") == "text"
    assert reader.integer("I", 0) == 42
    assert reader.number("N", 0.0) == 2.5
    assert reader.address("A", "") == "router:50052"
    assert reader.address("V6", "") == "[::1]:80"


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", True), ("TRUE", True), ("on", True), ("no", False), ("0", False)]
)
def test_booleans_accept_the_usual_spellings(raw, expected):
    assert EnvReader({"B": raw}).boolean("B", not expected) is expected


def test_the_default_is_read_from_os_environ(monkeypatch):
    monkeypatch.setenv("EXPERT_TEST_VALUE", "5")
    assert EnvReader().integer("EXPERT_TEST_VALUE", 0) == 5


@pytest.mark.parametrize(
    ("call", "raw", "message"),
    [
        (lambda r: r.integer("X", 0), "abc", "X: expected an integer, got 'abc'"),
        (lambda r: r.integer("X", 0), "1.5", "X: expected an integer"),
        (lambda r: r.integer("X", 0, minimum=1), "0", "X: must be at least 1, got 0"),
        (lambda r: r.integer("X", 0, maximum=9), "10", "X: must be at most 9, got 10"),
        (lambda r: r.integer("X", 0, minimum=0, maximum=9), "-1", "X: must be in [0, 9], got -1"),
        (lambda r: r.number("X", 0.0), "fast", "X: expected a number, got 'fast'"),
        (lambda r: r.number("X", 0.0), "nan", "X: expected a finite number"),
        (lambda r: r.number("X", 0.0, minimum=0.0, maximum=2.0), "3", "X: must be in [0.0, 2.0], got 3.0"),
        (lambda r: r.boolean("X", False), "maybe", "X: expected true or false, got 'maybe'"),
        (lambda r: r.address("X", ""), "localhost", "X: expected host:port, got 'localhost'"),
        (lambda r: r.address("X", ""), "host:port", "X: expected host:port"),
        (lambda r: r.address("X", ""), "host:70000", "X: port must be in [1, 65535], got 70000"),
        (lambda r: r.address("X", ""), "a b:1", "X: expected host:port"),
    ],
)
def test_malformed_values_raise_config_error_naming_the_variable(call, raw, message):
    with pytest.raises(ConfigError) as raised:
        call(EnvReader({"X": raw}))
    assert str(raised.value).startswith(message)
    assert isinstance(raised.value, ValueError)


def test_server_config_defaults():
    config = ServerConfig.from_env("router", 50052, 9152, env={})
    assert config == ServerConfig(bind_host="0.0.0.0", port=50052, metrics_port=9152, log_level="info")
    assert config.bind_address == "0.0.0.0:50052"


def test_server_config_reads_the_service_variables():
    env = {
        "EXPERT_BIND_HOST": "127.0.0.1",
        "EXPERT_ROUTER_PORT": "6000",
        "EXPERT_ROUTER_METRICS_PORT": "0",
        "EXPERT_LOG_LEVEL": "DEBUG",
        # Another service's variables are not ours.
        "EXPERT_ENGINE_PORT": "7000",
    }
    config = ServerConfig.from_env("router", 50052, 9152, env=env)
    assert config == ServerConfig(bind_host="127.0.0.1", port=6000, metrics_port=0, log_level="debug")


def test_server_config_brackets_an_ipv6_bind_host():
    config = ServerConfig.from_env("router", 50052, 9152, env={"EXPERT_BIND_HOST": "::"})
    assert config.bind_address == "[::]:50052"


@pytest.mark.parametrize(
    ("bind_host", "dialled"),
    [
        ("0.0.0.0", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("::", "[::1]"),
        ("::1", "[::1]"),
        ("10.0.0.5", "10.0.0.5"),
    ],
)
def test_a_local_client_dials_the_address_a_server_is_bound_to_never_localhost(bind_host, dialled):
    assert local_host(bind_host) == dialled


def test_every_default_target_is_the_ipv4_loopback():
    """`localhost` may resolve to ::1 too, where another user's process could listen
    (docs/operations.md#security)."""
    from services.engine.config import EngineServiceConfig
    from services.postproc.config import PostprocConfig
    from services.reception.config import ReceptionConfig
    from services.router.config import RouterConfig

    reception = ReceptionConfig.from_env({})
    engine = EngineServiceConfig.from_env({"EXPERT_BIND_HOST": "127.0.0.1"})
    addresses = [
        reception.router_target,
        reception.preparation_target,
        reception.postproc_target,
        engine.preparation_target,
        engine.advertise_address,
    ]
    assert all(address.startswith("127.0.0.1:") for address in addresses), addresses
    urls = [reception.redis_url, RouterConfig.from_env({}).redis_url, PostprocConfig.from_env({}).redis_url]
    assert urls == ["redis://127.0.0.1:6379/0"] * 3


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("EXPERT_ROUTER_PORT", "http"),
        ("EXPERT_ROUTER_PORT", "70000"),
        ("EXPERT_ROUTER_METRICS_PORT", "-1"),
        ("EXPERT_LOG_LEVEL", "verbose"),
        ("EXPERT_BIND_HOST", "local host"),
    ],
)
def test_server_config_refuses_bad_values_naming_the_variable(variable, raw):
    with pytest.raises(ConfigError, match=f"^{variable}: "):
        ServerConfig.from_env("router", 50052, 9152, env={variable: raw})


def test_server_config_is_frozen():
    config = ServerConfig.from_env("router", 50052, 9152, env={})
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
