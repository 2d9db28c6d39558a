"""transformers as the external reference: greedy decoding with full logits at every step."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain argmax decoding (no logits processors); returns the tokens and each step's logits."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(steps):
        last = out.logits[0, -1].float()
        logits.append(last)
        token = int(last.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def capture_logits(engine) -> list[torch.Tensor]:
    """Record every logits matrix the engine computes (observation only: the result is unchanged)."""
    captured: list[torch.Tensor] = []
    compute = engine.model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        captured.append(logits.clone())
        return logits

    engine.model.compute_logits = recording
    return captured
