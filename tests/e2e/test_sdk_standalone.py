"""The SDK on its own: `pip install sdk/python` into a fresh venv (no torch, no project), then a job
and a stream against a real stack from that venv.

The SDK and protos/ are copied into the test's directory first, as a fresh clone has them: no
generated stubs, so the build generates them (sdk/python/setup.py), and the repository's tree gets
no build output. Needs PyPI (the marker `network`): pip fetches grpcio, grpcio-status, protobuf and,
for the isolated build, setuptools and grpcio-tools (pip's cache makes a second run quick).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.network

# Run by the fresh venv's python, from a directory with nothing importable in it.
SCRIPT = r"""
import importlib.metadata
import importlib.util
import json
import sys

import expert_system
from expert_system import ExpertClient

try:
    import torch  # noqa: F401
except ImportError:
    has_torch = False
else:
    has_torch = True

dist = importlib.metadata.distribution("expert-system-sdk")
top_level = sorted(
    {f.parts[0] for f in dist.files if f.parts[0] != ".." and not f.parts[0].endswith(".dist-info")}
)
with ExpertClient(sys.argv[1]) as client:
    result = client.infer(prompt="Hello", raw=True, temperature=0.0, max_tokens=8, timeout_ms=60_000)
    stream = client.infer_stream(prompt="Hello", raw=True, temperature=0.0, max_tokens=8, timeout_ms=60_000)
    chunks = [chunk.text for chunk in stream]
print(
    json.dumps(
        {
            "has_torch": has_torch,
            "libs": importlib.util.find_spec("libs") is not None,
            "services": importlib.util.find_spec("services") is not None,
            "sdk_file": expert_system.__file__,
            "requires": dist.requires,
            "top_level": top_level,
            "infer": {
                "status": result.status,
                "text": result.text,
                "tokens": result.tokens_generated,
                "finish_reason": result.finish_reason,
            },
            "stream": {
                "status": stream.result.status,
                "text": stream.result.text,
                "tokens": stream.result.tokens_generated,
                "chunks": chunks,
            },
        }
    )
)
"""


def _fresh_clone_of_the_sdk(root: Path) -> Path:
    """sdk/python and protos/ as a fresh clone has them (no generated stubs, no build output)."""
    skip = shutil.ignore_patterns("_proto", "build", "*.egg-info", "__pycache__")
    shutil.copytree(REPO / "sdk" / "python", root / "sdk" / "python", ignore=skip)
    shutil.copytree(REPO / "protos", root / "protos", ignore=skip)
    return root / "sdk" / "python"


def _run(command: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}: {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_the_sdk_installed_alone_runs_jobs_on_a_real_stack(tiny_stack, tmp_path):
    sdk = _fresh_clone_of_the_sdk(tmp_path / "clone")
    venv = tmp_path / "venv"
    # The base interpreter, not this venv's: the new venv sees none of the project's packages.
    base = getattr(sys, "_base_executable", None) or sys.executable
    _run([base, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", str(sdk)], cwd=tmp_path, timeout=600)
    assert (sdk / "expert_system" / "_proto" / "expert" / "v1" / "inference_pb2_grpc.py").is_file()

    stack = tiny_stack()
    work = tmp_path / "work"
    work.mkdir()
    (work / "use_the_sdk.py").write_text(SCRIPT)
    run = _run([str(python), "use_the_sdk.py", stack.target("reception")], cwd=work, timeout=300)
    report = json.loads(run.stdout.strip().splitlines()[-1])

    assert not report["has_torch"] and not report["libs"] and not report["services"], report
    assert Path(report["sdk_file"]).is_relative_to(venv), report["sdk_file"]
    assert sorted(r.split(";")[0].split("<")[0].split(">")[0] for r in report["requires"]) == [
        "grpcio",
        "grpcio-status",
        "protobuf",
    ]
    assert report["top_level"] == ["expert_system"]
    assert not set(report["top_level"]) & sys.stdlib_module_names

    infer, stream = report["infer"], report["stream"]
    assert infer["status"] == "completed", infer
    assert 0 < infer["tokens"] <= 8, infer
    assert infer["finish_reason"] in ("stop", "length"), infer
    assert stream["status"] == "completed", stream
    assert 0 < stream["tokens"] <= 8, stream
    assert "".join(stream["chunks"]) == stream["text"]
    # Greedy decoding: the stream's job says what the plain one said.
    assert stream["text"] == infer["text"]
