"""bench/gpu.py's own rules, checked without a GPU: the shapes' parameter counts, the busy share
counting device activity only, and a failed or late section reported in its rows while the rest
runs (docs/engine.md#measuring-it-benchgpupy)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "bench"))
_spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
gpu = sys.modules["gpu_bench"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(gpu)
models, engine = sys.modules["gpu_models"], sys.modules["gpu_engine"]


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(gpu.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    args = argparse.Namespace(smoke=True, fp16=False, compiled=False, skip=set(), budget=None)
    return gpu.Bench(args)


def test_the_shapes_parameter_counts():
    assert models.num_parameters(models.LLAMA_1B) == 1_073_809_408
    assert models.size_label(models.LLAMA_1B) == "1.07B"
    assert models.num_parameters(models.LLAMA_8B) == 8_030_261_248
    assert models.size_label(models.LLAMA_8B) == "8.03B"


@pytest.mark.parametrize("shape", ["TINY", "TINY_8B"])
def test_the_parameter_count_is_transformers_count(shape):
    import torch

    model = models.build_hf(getattr(models, shape), torch.float32, torch.device("cpu"))
    assert models.num_parameters(getattr(models, shape)) == sum(p.numel() for p in model.parameters())


def test_the_busy_share_counts_kernels_copies_and_memsets_only():
    events = [
        {"cat": "cpu_op", "ts": 0, "dur": 1000},
        {"cat": "cuda_runtime", "ts": 0, "dur": 1000},
        {"cat": "gpu_user_annotation", "ts": 0, "dur": 1000},
        {"cat": "kernel", "ts": 100, "dur": 50},
        {"cat": "kernel", "ts": 120, "dur": 50},  # overlaps the one before: 100-170 counted once
        {"cat": "gpu_memcpy", "ts": 300, "dur": 10},
        {"cat": "gpu_memset", "ts": 400, "dur": 5},
        {"ph": "f", "cat": "ac2g", "ts": 500},
    ]
    assert engine.device_busy_us(events) == 70 + 10 + 5


def test_a_failed_section_says_why_in_its_rows_and_the_rest_runs(bench):
    def broken(_):
        raise RuntimeError("out of memory\nmore detail")

    bench.run(gpu.Section("parity", broken, 1))
    bench.run(gpu.Section("bound", gpu.hbm_bound, 1))
    assert bench.status == {"parity": "failed: RuntimeError: out of memory", "bound": "ok"}
    rows = {row[0]: row for row in gpu.table(bench)}
    assert rows["parity: float32 (ours) / bfloat16"][2] == "parity: failed: RuntimeError: out of memory"
    assert rows["attention decode us"][2] == "attention: not run"


def test_a_section_needing_a_failed_one_says_which(bench):
    bench.status["1b"] = "failed: RuntimeError: boom"
    bench.run(gpu.Section("busy", gpu.busy, 1))
    assert bench.status["busy"] == "failed: Unavailable: needs section 1b (failed: RuntimeError: boom)"


def test_no_section_begins_past_the_budget(bench):
    bench.args.budget = 1.0
    bench.started -= 2.0
    bench.run(gpu.Section("bound", gpu.hbm_bound, 1))
    assert bench.status["bound"] == "not run: past the 1 s budget"
