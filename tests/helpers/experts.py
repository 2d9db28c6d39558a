"""Signed `.expert` packages for engine tests, made the way a user makes them: PEFT saves an adapter,
`expertctl expert keygen` makes a key, `expertctl expert pack` signs the package."""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.expertctl.main import main as expertctl


@dataclass(frozen=True)
class Publisher:
    """A signing key and a trusted-keys directory that holds its public half."""

    key: Path
    trusted: Path

    @classmethod
    def create(cls, root: Path) -> Publisher:
        keys = root / "keys"
        if expertctl(["expert", "keygen", "--out", str(keys)]) != 0:
            raise RuntimeError("expertctl expert keygen failed")
        trusted = root / "trusted"
        trusted.mkdir()
        shutil.copy(keys / "signing.pub", trusted / "publisher.pub")
        return cls(keys / "signing.key", trusted)

    def pack(
        self, peft_dir: Path, base: Path, out: Path, name: str, version: str = "1.0.0", *extra: str
    ) -> Path:
        """Pack and sign a PEFT directory with `expertctl expert pack`."""
        args = [
            "expert",
            "pack",
            str(peft_dir),
            "--name",
            name,
            "--version",
            version,
            "--description",
            f"test expert {name}",
            "--base-model",
            str(base),
            "--key",
            str(self.key),
            "--out",
            str(out),
            *extra,
        ]
        if expertctl(args) != 0:
            raise RuntimeError(f"expertctl {' '.join(args)} failed")
        return out


def peft_model(base: Path, adapters: dict[str, Path], dtype: torch.dtype = torch.float32) -> Any:
    """The base model in `dtype` with the PEFT adapters loaded by name (the first one active; peft
    keeps adapter weights in float32 on a half-precision model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = list(adapters)
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=dtype),
            adapters[names[0]],
            adapter_name=names[0],
        )
        for name in names[1:]:
            model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.inference_mode()
def peft_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding by full forward passes (every adapter kind, prompt tuning included, handles that)."""
    sequence = torch.tensor([prompt])
    tokens = []
    for _ in range(steps):
        logits = model(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
    return tokens
