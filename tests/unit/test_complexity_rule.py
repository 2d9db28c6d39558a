"""`make lint` holds production code to a McCabe complexity of 10 (ruff's C901, pyproject.toml's
[tool.ruff.lint.mccabe]); tests and benchmarks are left out (docs/architecture.md#where-code-lives)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).with_name("ruff")


def branches(count: int) -> str:
    """A function of McCabe complexity `count` + 1: one `if` per branch."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(count))
    return f"def f(x):\n{body}    return -1\n"


def ruff_complexity(path: str, source: str) -> subprocess.CompletedProcess:
    """ruff's C901 with the project's settings on `source`, as if it were the file at `path`."""
    return subprocess.run(
        [
            *(str(RUFF), "check", "--config", str(REPO / "pyproject.toml"), "--select", "C901"),
            *("--stdin-filename", str(REPO / path), "-"),
        ],
        input=source,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("path", ["libs/probe.py", "services/router/probe.py", "tools/probe.py"])
def test_production_code_is_held_to_complexity_ten(path):
    assert ruff_complexity(path, branches(9)).returncode == 0  # complexity 10: allowed
    refused = ruff_complexity(path, branches(10))  # 11: refused
    assert refused.returncode == 1 and "C901" in refused.stdout and "(11 > 10)" in refused.stdout


@pytest.mark.parametrize("path", ["tests/unit/test_probe.py", "bench/probe.py"])
def test_tests_and_benchmarks_are_left_out(path):
    assert ruff_complexity(path, branches(20)).returncode == 0
