"""How similar must a prompt be to an expert's vector for retrieval to take the expert: the floor.

A fixed cosine floor means different things for different encoders and experts: with
all-MiniLM-L6-v2, a prompt and the expert made for it reach 0.4–0.8, while an expert known only by its
description rarely passes 0.6 even for prompts of its kind. So by default each expert's floor is
calibrated against a corpus of generic prompts that no expert should take (`background_prompts.txt`):
the floor is the similarity that the corpus's `quantile` reaches to the expert's vector, plus a
`margin`. An expert with a broad vector (its prompts resemble everyday requests) thus needs a closer
match than one with a narrow vector. `EXPERT_ROUTER_SIMILARITY_FLOOR` set to a number gives every
expert that fixed floor instead (0.6 is the original design's).

The floors are computed with the routing snapshot (`RoutingTags`), so they follow every registration,
and the corpus is encoded once per router, on the first snapshot that has experts.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from services.router.embedding import SentenceEncoder
from services.router.matching import stems

BACKGROUND_FILE = Path(__file__).with_name("background_prompts.txt")
CALIBRATED = "calibrated"
_ENCODED: weakref.WeakKeyDictionary[SentenceEncoder, dict[tuple[str, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class FloorRule:
    """`fixed` None: calibrated floors (`quantile` of the background's similarities + `margin`)."""

    fixed: float | None = None
    quantile: float = 0.99
    margin: float = 0.05

    def describe(self) -> str:
        if self.fixed is not None:
            return f"similarity >= {self.fixed:g}"
        return f"similarity >= each expert's floor (background q{self.quantile:g} + {self.margin:g})"


class Background:
    """The generic-prompt corpus, encoded on first use. The encoding is kept per encoder, so indexes
    sharing an encoder encode it once (thread-safe: plans run on executor threads). Its words also
    tell how common a word of an expert's description is (`matching.AuthorWords`)."""

    def __init__(self, encoder: SentenceEncoder, prompts: list[str] | None = None) -> None:
        self.encoder = encoder
        self.prompts = tuple(prompts if prompts is not None else read_background())

    @property
    def vectors(self) -> torch.Tensor:
        """[N, dim], unit rows."""
        with _LOCK:
            encoded = _ENCODED.setdefault(self.encoder, {})
            if self.prompts not in encoded:
                encoded[self.prompts] = self.encoder.encode(list(self.prompts))
            return encoded[self.prompts]

    @cached_property
    def stems(self) -> tuple[frozenset[str], ...]:
        """Each prompt's word stems: the generic documents of the author's words' rarity."""
        return tuple(stems(prompt) for prompt in self.prompts)

    def floors(self, expert_vectors: torch.Tensor, rule: FloorRule) -> torch.Tensor:
        """Each expert's floor, [E] for expert_vectors [E, dim] (unit rows)."""
        if rule.fixed is not None:
            return torch.full((expert_vectors.shape[0],), rule.fixed)
        if expert_vectors.shape[0] == 0:
            return torch.empty(0)
        similarities = expert_vectors @ self.vectors.T  # [E, N]
        return torch.quantile(similarities, rule.quantile, dim=1) + rule.margin


DEFAULT_FLOOR = FloorRule()


def read_background(path: Path = BACKGROUND_FILE) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
