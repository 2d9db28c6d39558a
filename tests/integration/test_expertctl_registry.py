"""`expertctl expert install|list|show|remove` (also named `experts`) against a real router process
(embedded Qdrant, the real encoder) and a real expert store: packages made with `expertctl expert
keygen|pack`, refusals with a message and a non-zero status, and a registry that outlives a router
restart."""

from __future__ import annotations

import json

import pytest

from tests.helpers.experts import Publisher
from tests.helpers.peft_adapters import write_all_adapters
from tools.expertctl.main import main as expertctl
from tools.stack import LocalStack


@pytest.fixture
def setup(tiny_llama, tiny_checkpoints, tmp_path):
    peft = write_all_adapters(tiny_llama, tmp_path / "peft")["lora"]
    publisher = Publisher.create(tmp_path / "publisher")
    stack = LocalStack.on_free_ports(tmp_path / "stack")
    stack.start_redis()  # the router learns from the feedback stream
    stack.start_service("router")
    stack.wait_serving("router")

    def run(*args: str) -> int:
        options = ["--router", stack.target("router")]
        if args[1] == "install":
            options += [
                "--store",
                str(tmp_path / "store"),
                "--trusted",
                str(publisher.trusted),
                "--model",
                str(tiny_llama),
            ]
        elif args[1] in ("show", "remove"):
            options += ["--store", str(tmp_path / "store")]
        return expertctl([*args, *options])

    def pack(name: str, version: str = "1.0.0", *extra: str):
        out = tmp_path / f"{name}-{version}-{len(extra)}.expert"
        return publisher.pack(peft, tiny_llama, out, name, version, "--task-types", "json_parsing", *extra)

    yield run, pack, stack, tmp_path
    stack.stop()


def test_install_list_show_and_remove(setup, capsys):
    run, pack, _, tmp_path = setup
    package = pack("json-parser")
    assert run("expert", "install", str(package)) == 0
    assert "json-parser@1.0.0 installed" in capsys.readouterr().out
    # The same package again, under the plural noun: harmless (`expert` and `experts` are one command).
    assert run("experts", "install", str(package)) == 0
    assert "already in the store" in capsys.readouterr().out
    assert run("expert", "list", "--json") == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["task_types"], listed["success_rate"]) == (
        "json-parser",
        ["json_parsing"],
        0.5,
    )
    assert run("experts", "show", "json-parser", "--json") == 0
    assert json.loads(capsys.readouterr().out)["stored_versions"] == ["1.0.0"]
    assert run("experts", "remove", "json-parser") == 0
    assert "packages deleted: 1.0.0" in capsys.readouterr().out
    assert not list((tmp_path / "store").rglob("*.expert"))
    assert run("experts", "show", "json-parser") == 1
    assert "not registered" in capsys.readouterr().err


def test_refusals_have_a_message_and_a_status(setup, capsys, tiny_checkpoints):
    run, pack, _, tmp_path = setup
    assert run("expert", "install", str(pack("json-parser"))) == 0
    capsys.readouterr()
    changed = pack("json-parser", "1.0.0", "--keywords", "changed")
    assert run("expert", "install", str(changed)) == 1
    assert "already installed with other content" in capsys.readouterr().err
    other_model = ["--model", str(tiny_checkpoints["qwen2"])]
    assert (
        expertctl(
            [
                "expert",
                "install",
                str(pack("sql-writer")),
                "--router",
                "127.0.0.1:1",
                "--store",
                str(tmp_path / "store"),
                "--trusted",
                str(setup[3] / "publisher" / "trusted"),
                *other_model,
            ]
        )
        == 1
    )
    assert "another base model" in capsys.readouterr().err
    assert run("expert", "install", str(tmp_path / "missing.expert")) == 2
    assert "is not a file" in capsys.readouterr().err


def test_an_unreachable_router_leaves_the_package_stored_and_says_so(setup, capsys, tiny_llama):
    _, pack, _, tmp_path = setup
    status = expertctl(
        [
            "expert",
            "install",
            str(pack("json-parser")),
            "--router",
            "127.0.0.1:1",
            "--store",
            str(tmp_path / "store"),
            "--trusted",
            str(tmp_path / "publisher" / "trusted"),
            "--model",
            str(tiny_llama),
        ]
    )
    assert status == 1
    assert "is in the store, but the router" in capsys.readouterr().err
    assert list((tmp_path / "store").rglob("*.expert"))


def test_the_registry_outlives_a_router_restart(setup, capsys):
    run, pack, stack, _ = setup
    assert run("expert", "install", str(pack("json-parser"))) == 0
    stack.stop_service("router")
    stack.start_service("router")
    stack.wait_serving("router")
    capsys.readouterr()
    assert run("experts", "list", "--json") == 0
    assert [e["name"] for e in json.loads(capsys.readouterr().out)] == ["json-parser"]
