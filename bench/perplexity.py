"""Perplexity of a model on held-out English text, computed by our engine itself.

The text (bench/data/heldout_english.txt, about 4,300 tokens) was written for this benchmark, so
no model has seen it. It is cut into windows of `window` tokens; each window runs through the
engine as one prompt, and the hidden states its forward pass computes for every position go
through the engine's own LM head. The perplexity is exp(mean negative log-likelihood) of every
token after the first of each window.

    python bench/perplexity.py --model data/models/SmolLM2-135M-Instruct --quantization int4
    python bench/perplexity.py --kv-cache-dtype int8      # K and V stored as 8-bit codes
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "heldout_english.txt"


def text_token_ids(engine) -> list[int]:
    return engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"))


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """The text cut into windows of `window` tokens (a last one of a single token is dropped)."""
    return [
        token_ids[i : i + window]
        for i in range(0, len(token_ids) - 1, window)
        if len(token_ids[i : i + window]) > 1
    ]


def perplexity_engine(model: str, quantization: str | None, window: int, kv_cache_dtype: str = "auto"):
    """An engine that takes a whole window in one prefill step, with no prefix cache. The prefill's
    attention reads the keys and values back from the cache, so an int8 cache is measured too."""
    from libs.engine import LLMEngine

    return LLMEngine.from_pretrained(
        model,
        device="cpu",
        dtype="float32",
        quantization=quantization,
        max_model_len=max(1024, window + 1),
        max_num_batched_tokens=max(2048, window),
        num_blocks=2 * (window // 16 + 2),
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )


def perplexity(engine, token_ids: list[int], window: int = 512) -> tuple[float, int]:
    """(perplexity, tokens scored) of `token_ids` under `engine`'s model, window by window."""
    from libs.engine import SamplingParams

    model = engine.model
    captured: list[torch.Tensor] = []
    forward = model.forward

    def recording(input_ids, *args, **kwargs):
        hidden = forward(input_ids, *args, **kwargs)
        captured.append(hidden.clone())
        return hidden

    model.forward = recording
    nll, count = 0.0, 0
    try:
        for chunk in windows(token_ids, window):
            captured.clear()
            # A window is one prefill step (max_num_batched_tokens >= window): all its positions'
            # hidden states come out of one forward pass.
            engine.generate([chunk], SamplingParams(max_tokens=1, temperature=0.0))
            hidden = captured[0][: len(chunk)]
            logits = model.compute_logits(hidden[:-1])
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            targets = torch.tensor(chunk[1:])
            nll -= float(logprobs[torch.arange(len(targets)), targets].sum())
            count += len(targets)
    finally:
        model.forward = forward
    return math.exp(nll / count), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    engine = perplexity_engine(args.model, quantization, args.window, args.kv_cache_dtype)
    value, count = perplexity(engine, text_token_ids(engine), args.window)
    print(f"perplexity {value:.4f} over {count} tokens ({args.quantization}, KV cache {args.kv_cache_dtype})")


if __name__ == "__main__":
    main()
