"""`expertctl expert`: keygen, pack, verify and inspect as a user runs them; refusals are one
`expertctl: error:` line with status 1 (2 for bad input), never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from libs.experts.manifest import BaseModelIdentity
from libs.experts.package import inspect_package
from tests.helpers.peft_adapters import write_all_adapters
from tools.expertctl import expert_cmd
from tools.expertctl.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    assert main(["expert", "keygen", "--out", str(directory)]) == 0
    return directory


def pack(adapter_dir: Path, keys: Path, out: Path, *extra: str) -> int:
    args = ["expert", "pack", str(adapter_dir), "--name", "sql-helper", "--version", "1.0.0"]
    args += ["--description", "Writes SQL.", "--key", str(keys / "signing.key"), "--out", str(out)]
    return main([*args, *extra])


def one_error_line(err: str) -> str:
    assert err.startswith("expertctl: error: ") and "Traceback" not in err
    return err.splitlines()[-1]


# -- keygen -----------------------------------------------------------------------------------------


def test_keygen_prints_the_key_id_the_paths_and_where_the_public_key_goes(tmp_path, capsys):
    assert main(["expert", "keygen", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "signing.key") in out and str(tmp_path / "signing.pub") in out
    assert "key id:" in out and "trusted keys directory" in out


def test_keygen_refuses_to_overwrite_with_status_2(keys, capsys):
    assert main(["expert", "keygen", "--out", str(keys)]) == 2
    assert "already exists" in one_error_line(capsys.readouterr().err)


# -- pack and verify --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "ia3", "soft_prompt"])
def test_a_packed_adapter_verifies_against_its_key(adapters, keys, tmp_path, capsys, kind):
    out = tmp_path / "sql.expert"
    assert pack(adapters[kind], keys, out) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "content hash:" in printed and "signed by:" in printed
    assert main(["expert", "verify", str(out), "--trusted", str(keys)]) == 0
    summary = capsys.readouterr().out
    assert len(summary.splitlines()) == 1 and f"sql-helper 1.0.0 ({kind})" in summary and "OK" in summary


def test_pack_takes_every_manifest_option(adapters, keys, tmp_path):
    (tmp_path / "examples.txt").write_text("How do I join two tables?\n\nWrite a SELECT.\n")
    out = tmp_path / "sql.expert"
    extra = ["--keywords", "sql, join", "--capabilities", "sql", "--task-types", "code_generation"]
    extra += ["--examples", str(tmp_path / "examples.txt"), "--priority", "7"]
    extra += ["--incompatible-with", "json-parser,other-one", "--author", "Data team"]
    assert pack(adapters["lora"], keys, out, *extra) == 0
    manifest = inspect_package(out).manifest
    assert manifest.keywords == ("sql", "join") and manifest.capabilities == ("sql",)
    assert manifest.task_types == ("code_generation",) and manifest.priority == 7
    assert manifest.examples == ("How do I join two tables?", "Write a SELECT.")
    assert manifest.incompatible_with == ("json-parser", "other-one") and manifest.author == "Data team"


def test_examples_may_be_a_json_list(adapters, keys, tmp_path):
    (tmp_path / "examples.json").write_text(json.dumps(["one\nwith a newline", "two"]))
    assert (
        pack(adapters["lora"], keys, tmp_path / "a.expert", "--examples", str(tmp_path / "examples.json"))
        == 0
    )
    assert inspect_package(tmp_path / "a.expert").manifest.examples == ("one\nwith a newline", "two")


def test_the_base_model_defaults_to_the_adapters_own(adapters, keys, tmp_path, tiny_llama):
    assert pack(adapters["lora"], keys, tmp_path / "a.expert") == 0
    assert inspect_package(tmp_path / "a.expert").manifest.base_model == BaseModelIdentity.from_dir(
        tiny_llama
    )


def test_the_base_model_falls_back_to_the_default_model(
    adapters, keys, tmp_path, monkeypatch, tiny_checkpoints
):
    moved = shutil.copytree(adapters["lora"], tmp_path / "adapter")
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "org/gone"}))
    monkeypatch.setattr(expert_cmd, "DEFAULT_MODEL_DIR", tiny_checkpoints["qwen2"])
    assert pack(moved, keys, tmp_path / "a.expert") == 0
    identity = inspect_package(tmp_path / "a.expert").manifest.base_model
    assert identity == BaseModelIdentity.from_dir(tiny_checkpoints["qwen2"])


def test_verify_checks_the_base_model_when_given(
    adapters, keys, tmp_path, capsys, tiny_llama, tiny_checkpoints
):
    out = tmp_path / "a.expert"
    assert pack(adapters["lora"], keys, out) == 0
    assert main(["expert", "verify", str(out), "--trusted", str(keys), "--base-model", str(tiny_llama)]) == 0
    assert f"fits {tiny_llama}" in capsys.readouterr().out
    other = tiny_checkpoints["qwen2"]
    assert main(["expert", "verify", str(out), "--trusted", str(keys), "--base-model", str(other)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "does not fit the base model" in line and "architecture: package LlamaForCausalLM" in line


def test_verify_refuses_a_package_signed_by_an_untrusted_key(adapters, keys, tmp_path, capsys):
    assert pack(adapters["lora"], keys, tmp_path / "a.expert") == 0
    assert main(["expert", "keygen", "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert main(["expert", "verify", str(tmp_path / "a.expert"), "--trusted", str(tmp_path / "other")]) == 1
    assert "not in the trusted keyring" in one_error_line(capsys.readouterr().err)


def test_verify_refuses_a_damaged_package(adapters, keys, tmp_path, capsys):
    out = tmp_path / "a.expert"
    assert pack(adapters["lora"], keys, out) == 0
    out.write_bytes(out.read_bytes()[:-100])
    assert main(["expert", "verify", str(out), "--trusted", str(keys)]) == 1
    assert f"{out}: not a .expert package" in one_error_line(capsys.readouterr().err)


def test_verify_names_a_missing_package_once(keys, tmp_path, capsys):
    missing = tmp_path / "absent.expert"
    assert main(["expert", "verify", str(missing), "--trusted", str(keys)]) == 1
    assert one_error_line(capsys.readouterr().err) == f"expertctl: error: {missing}: no such file"


def test_verify_names_a_missing_trusted_directory(tmp_path, capsys):
    assert main(["expert", "verify", str(tmp_path / "a.expert"), "--trusted", str(tmp_path / "none")]) == 1
    assert "--trusted: trusted keys directory" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--name", "../x"], "manifest.name: '../x' does not match"),
        (["--version", "1.0"], "manifest.version:"),
        (["--priority", "5000"], "manifest.priority:"),
        (["--incompatible-with", "sql-helper"], "an expert cannot exclude itself"),
        (["--out", "x.tar.gz"], "does not end with .expert"),
        (["--base-model", "/nonexistent"], "--base-model: /nonexistent is not a checkpoint directory"),
        (["--key", "/nonexistent.key"], "no such private key file"),
    ],
)
def test_pack_refuses_bad_input_with_status_2(adapters, keys, tmp_path, capsys, change, message):
    assert pack(adapters["lora"], keys, tmp_path / "a.expert", *change) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "a.expert").exists()


def test_pack_refuses_an_adapter_the_engine_cannot_apply(adapters, keys, tmp_path, capsys):
    moved = shutil.copytree(adapters["lora"], tmp_path / "adapter")
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    assert pack(moved, keys, tmp_path / "a.expert") == 2
    assert "adapter_config.json: use_dora:" in one_error_line(capsys.readouterr().err)


def test_pack_does_not_replace_a_package_without_force(adapters, keys, tmp_path, capsys):
    out = tmp_path / "a.expert"
    assert pack(adapters["lora"], keys, out) == 0
    assert pack(adapters["ia3"], keys, out) == 2
    assert "--force" in one_error_line(capsys.readouterr().err)
    assert pack(adapters["ia3"], keys, out, "--force") == 0
    assert inspect_package(out).manifest.adapter_type == "ia3"


# -- inspect ----------------------------------------------------------------------------------------


def test_inspect_prints_the_manifest_files_tensors_and_vram(adapters, keys, tmp_path, capsys):
    out = tmp_path / "a.expert"
    assert pack(adapters["lora"], keys, out, "--keywords", "sql") == 0
    capsys.readouterr()
    assert main(["expert", "inspect", str(out), "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    info = inspect_package(out, dtype="bfloat16")
    assert "sql-helper 1.0.0 (lora, rank 8, alpha 16" in printed and "keywords     sql" in printed
    assert "adapter_model.safetensors" in printed and f"{info.num_parameters:,} parameters" in printed
    assert f"{info.vram_mb:.3f} MiB as bfloat16" in printed


def test_inspect_json_is_the_full_report(adapters, keys, tmp_path, capsys):
    out = tmp_path / "a.expert"
    assert pack(adapters["ia3"], keys, out) == 0
    capsys.readouterr()
    assert main(["expert", "inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(json.dumps(inspect_package(out).to_dict()))
    assert report["manifest"]["adapter_type"] == "ia3" and report["checksums_ok"] is True


def test_inspect_refuses_a_file_that_is_not_a_package(tmp_path, capsys):
    (tmp_path / "a.expert").write_text("hello")
    assert main(["expert", "inspect", str(tmp_path / "a.expert")]) == 1
    assert "not a gzip-compressed tar" in one_error_line(capsys.readouterr().err)


def test_an_unknown_dtype_is_a_usage_error(tmp_path, capsys):
    assert main(["expert", "inspect", str(tmp_path / "a.expert"), "--dtype", "int4"]) == 2
    assert "expertctl: error: " in capsys.readouterr().err


# -- the real process -------------------------------------------------------------------------------


def test_a_refusal_in_a_real_process_prints_no_traceback(adapters, keys, tmp_path):
    out = tmp_path / "a.expert"
    assert pack(adapters["lora"], keys, out) == 0
    untrusted = tmp_path / "untrusted"
    untrusted.mkdir()
    command = [
        sys.executable,
        "-m",
        "tools.expertctl.main",
        "expert",
        "verify",
        str(out),
        "--trusted",
        str(untrusted),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"expertctl: error: {out}: signature.json: signed by key ")
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_expert_and_experts_are_one_command_with_every_action():
    from tools.expertctl.main import build_parser

    parser = build_parser()
    for action in (
        ["install", "x.expert"],
        ["list"],
        ["show", "x"],
        ["remove", "x"],
        ["inspect", "x.expert"],
    ):
        singular, plural = (parser.parse_args([noun, *action]) for noun in ("expert", "experts"))
        assert singular.handler is plural.handler, action
