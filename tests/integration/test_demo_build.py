"""`make experts`'s builder on a tiny model: it trains as `expertctl expert train` does, signs with
the demo key it makes and trusts, a second run keeps what is up to date, and the set installs into a
store and a real router as `expertctl expert install` installs."""

from __future__ import annotations

import json

import pytest

from libs.experts.package import read_package
from libs.experts.signing import Keyring
from libs.experts.store import ExpertStore
from tools.demo.build import BuildError, build, demo_key, install
from tools.demo.catalog import Recipe
from tools.demo.dates import DateNormalisation
from tools.demo.tickets import TicketTriage
from tools.expertctl.main import main as expertctl
from tools.stack import LocalStack, free_port

RECIPES = (
    Recipe(DateNormalisation(), num_train=24, epochs=1, learning_rate=1e-3, batch_size=8),
    Recipe(TicketTriage(), num_train=24, epochs=1, learning_rate=1e-2, batch_size=8),
)


def test_the_set_is_built_signed_trusted_and_then_kept(tiny_llama, tmp_path):
    key = demo_key(tmp_path / "keys", tmp_path / "trusted")
    first = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=RECIPES)
    assert [b.name for b in first] == ["date-normalize", "ticket-triage"] and all(
        b.seconds > 0 for b in first
    )
    trusted = Keyring.from_dir(tmp_path / "trusted")
    packages = [read_package(b.package, trusted) for b in first]
    assert [p.manifest.adapter_type for p in packages] == ["lora", "ia3"]
    assert all(len(p.manifest.examples) == 22 for p in packages)  # the training prompts less the 2 held out

    again = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=RECIPES)
    assert [b.seconds for b in again] == [0.0, 0.0]
    assert [b.package.read_bytes() for b in again] == [b.package.read_bytes() for b in first]

    changed = (Recipe(DateNormalisation(), num_train=24, epochs=1, learning_rate=2e-3, batch_size=8),)
    (retrained,) = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=changed)
    assert retrained.seconds > 0


def test_the_set_installs_into_the_store_and_the_router(tiny_llama, tmp_path, monkeypatch, capsys):
    key = demo_key(tmp_path / "keys", tmp_path / "trusted")
    built = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=RECIPES[:1])
    monkeypatch.setenv("EXPERT_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("EXPERT_TRUSTED_KEYS", str(tmp_path / "trusted"))
    stack = LocalStack.on_free_ports(tmp_path / "stack")
    try:
        stack.start_redis()
        stack.start_service("router")
        stack.wait_serving("router")
        capsys.readouterr()
        install([b.package for b in built], tiny_llama, stack.target("router"))
        assert "date-normalize@1.0.0 installed" in capsys.readouterr().out
        install([b.package for b in built], tiny_llama, stack.target("router"))
        assert "date-normalize@1.0.0 was already in the store" in capsys.readouterr().out
        assert [e.version for e in ExpertStore(tmp_path / "store").versions("date-normalize")] == ["1.0.0"]
        assert expertctl(["experts", "list", "--json", "--router", stack.target("router")]) == 0
        assert [e["name"] for e in json.loads(capsys.readouterr().out)] == ["date-normalize"]
    finally:
        stack.stop()


def test_installing_without_a_router_says_so(tiny_llama, tmp_path, monkeypatch):
    key = demo_key(tmp_path / "keys", tmp_path / "trusted")
    built = build(tiny_llama, tmp_path / "experts", key, log=lambda _: None, recipes=RECIPES[:1])
    monkeypatch.setenv("EXPERT_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("EXPERT_TRUSTED_KEYS", str(tmp_path / "trusted"))
    with pytest.raises(BuildError, match=r"did not register it .*is the stack running"):
        install([b.package for b in built], tiny_llama, f"127.0.0.1:{free_port()}")
