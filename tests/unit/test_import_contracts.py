"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and each one fails when it is
broken: imports go one way (tools -> services -> libs), the services (the five stages and the
trainer) are independent, libs imports no service and no tool, the SDK stands alone, the engine
library imports neither the trainer nor the command line, the demo set does not go through the
command line, and no package has an import cycle (function-level and TYPE_CHECKING imports
included). `make lint` runs the same check; here it gates CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
SERVICES = ("reception", "router", "preparation", "engine", "postproc", "trainer")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the project's contracts, on the packages found from `cwd` first."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(REPO / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_tree_keeps_every_import_contract():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The smallest tree the contracts apply to: each package they name, and the contract type."""
    packages = [
        "libs",
        "libs/engine",
        "services",
        *(f"services/{name}" for name in SERVICES),
        "tools",
        "tools/demo",
        "tools/expertctl",
        "tools/training",
        "libs/training",
        "expert_system",
    ]
    for package in packages:
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tools/expertctl/main.py").write_text("")
    (tmp_path / "libs/training/trainer.py").write_text("")
    contract_types = REPO / "tools/lint"
    shutil.copytree(contract_types, tmp_path / "tools/lint", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_smallest_tree_keeps_every_contract(tree):
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr


BREAKS = {
    "a library imports a tool": (
        {"libs/probe.py": "import tools.expertctl.main\n"},
        ["Imports go one way: tools -> services -> libs", "libs imports neither a service nor a tool"],
    ),
    "a library imports a service": (
        {"libs/probe.py": "def f():\n    import services.router\n"},
        ["Imports go one way: tools -> services -> libs", "libs imports neither a service nor a tool"],
    ),
    "a service imports a tool": (
        {"services/router/probe.py": "import tools.demo\n"},
        ["Imports go one way: tools -> services -> libs"],
    ),
    "a service imports another": (
        {"services/postproc/probe.py": "from services.router import __name__\n"},
        ["The services do not import each other"],
    ),
    "the SDK imports libs": (
        {"expert_system/probe.py": "import libs\n"},
        ["The SDK stands alone"],
    ),
    "the engine library imports the trainer": (
        {"libs/engine/probe.py": "def f():\n    from libs.training import trainer\n"},
        ["The engine library imports neither the expert training nor the command line"],
    ),
    "the demo set calls the command line": (
        {"tools/demo/probe.py": "from tools.expertctl.main import __name__\n"},
        ["The demo set builds through the libraries, not the command line"],
    ),
    "two SDK modules import each other, one only for type checking": (
        {
            "expert_system/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import b\n",
            "expert_system/b.py": "from . import a\n",
        },
        ["No import cycles among the modules of libs, services, tools or the SDK"],
    ),
    "three tools modules import each other in a ring": (
        {
            "tools/training/a.py": "import tools.training.b\n",
            "tools/training/b.py": "import tools.training.c\n",
            "tools/training/c.py": "def f():\n    import tools.training.a\n",
        },
        ["No import cycles among the modules of libs, services, tools or the SDK"],
    ),
}


@pytest.mark.parametrize("files, broken", BREAKS.values(), ids=BREAKS.keys())
def test_a_forbidden_import_breaks_its_contracts(tree, files, broken):
    for path, text in files.items():
        (tree / path).write_text(text)
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    reported = {line.removesuffix(" BROKEN") for line in lines if line.endswith(" BROKEN")}
    assert reported == set(broken), result.stdout
