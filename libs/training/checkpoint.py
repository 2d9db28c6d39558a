"""A training checkpoint: everything a run needs to go on exactly where it stopped.

A checkpoint is a directory: `adapter/` (the adapter at that step, as peft saves it, usable on its
own) and `trainer_state.pt` (the adapter's trainable tensors, the best epoch's tensors, AdamW's and
the schedule's state, the torch RNG states, and the loop's counters). It is written beside its
final name and renamed into place, so a crash while writing leaves no half checkpoint. It is read
with `torch.load(weights_only=True)`: only tensors and plain values, never pickled code.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.pt"
ADAPTER_DIR = "adapter"


def write_checkpoint(directory: Path, model, state: dict[str, Any]) -> None:
    """Write `state` and the model's adapter as checkpoint `directory` (replacing one there)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        model.save_pretrained(staging / ADAPTER_DIR)
        torch.save(state, staging / STATE_FILE)
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_checkpoint(directory: Path) -> dict[str, Any]:
    """The state a checkpoint holds (tensors on the CPU). Raises FileNotFoundError when it is gone."""
    return torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)


def is_checkpoint(directory: Path) -> bool:
    return (directory / STATE_FILE).is_file() and (directory / ADAPTER_DIR).is_dir()


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
