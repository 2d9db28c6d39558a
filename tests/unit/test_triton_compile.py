"""The Triton kernels compile for a Hopper GPU (sm_90), with Triton's compiler and ptxas and no GPU:
the interpreter that runs them on CPU tensors in the other tests accepts programs the GPU compiler
refuses (dot shapes, layouts, mixed types)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset; 1 is its default
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.triton_compile"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") >= 30
