"""How a prompt is compared with an expert, beyond one cosine of two embeddings.

Retrieval (the experts nearest the prompt's embedding, k = 30, each above a floor) is kept;
three rules decide what "nearest" means, each measured on the routing benchmark (`docs/experts.md`):

- **Sentences.** A request often wraps its task in context ("We moved offices last week. Convert
  12 miles to km."), and one embedding of the whole dilutes the task. The prompt is encoded whole and
  sentence by sentence (up to `MAX_SENTENCES` of at least `MIN_SENTENCE_CHARS` characters); an
  expert's similarity is the best of them, a sentence's less `SENTENCE_MARGIN`: every sentence is
  one more draw against a floor calibrated for one embedding per prompt, and without the margin the
  context sentences of a prompt ("Contact: ana@example.com.") bring in experts it does not need.
- **Keywords.** When the prompt contains one of the expert's keywords as whole words (any case), the
  similarity gets `keyword_boost` added: the author's own words for the expert are the strongest
  evidence there is, and a sentence encoder weighs a shared word less than that.
- **Topic gate.** A question about an expert's subject ("Who invented regular expressions?") is as
  close to the expert as a task for it. At registration each expert with keywords gets topic probes:
  small-talk questions about each of its first `PROBED_KEYWORDS` keywords (`topic_probes`). An
  expert is not taken when the whole prompt is at least as similar to its nearest probe as to the
  expert and to each text the expert is known by (its description, keywords line and examples): a
  keyword that is itself a task ("kilometers to meters") makes probes that resemble tasks, and the
  expert's examples of such tasks resemble them more.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.router.embedding import SentenceEncoder

MAX_SENTENCES = 8
MIN_SENTENCE_CHARS = 8
SENTENCE_MARGIN = 0.08
_SENTENCE_END = re.compile(r"(?<=[.!?:])\s+|\n+")
# A word, with inner punctuation kept ("tl;dr", "e-mail", "don't"), or one punctuation mark ("c++").
_WORD = re.compile(r"\w+(?:[^\w\s]+\w+)*|[^\w\s]")

PROBED_KEYWORDS = 10
TOPIC_TEMPLATES = (
    "What is the history of {}?",
    "Who invented {}?",
    "Why do people find {} difficult?",
    "Tell me some interesting facts about {}.",
    "Is {} worth learning?",
    "What do you think about {}?",
)


@dataclass(frozen=True)
class MatchRule:
    """The tunable parts: the keyword boost (0 turns it off), whether the topic gate applies, and the
    companion ratio: selection composes a non-forced expert with the leading one only when its
    similarity is at least this share of the leader's (0 composes every candidate, as the original
    design did)."""

    keyword_boost: float = 0.15
    topic_gate: bool = True
    companion_ratio: float = 0.5

    def describe(self) -> str:
        return (
            f"keyword boost {self.keyword_boost:g}, topic gate {'on' if self.topic_gate else 'off'}, "
            f"companions >= {self.companion_ratio:g} x the leader's similarity"
        )


DEFAULT_MATCHING = MatchRule()


def sentences(text: str) -> list[str]:
    """The prompt's sentences worth encoding apart: none when it has only one."""
    parts = [p.strip() for p in _SENTENCE_END.split(text)]
    parts = [p for p in parts if len(p) >= MIN_SENTENCE_CHARS]
    return parts[:MAX_SENTENCES] if len(parts) > 1 else []


@dataclass(frozen=True)
class PromptQuery:
    """A prompt as retrieval sees it: its text and its embeddings (row 0 the whole prompt, then one row
    per sentence)."""

    text: str
    vectors: torch.Tensor  # [1 + sentences, dim], unit rows

    @classmethod
    def encode(cls, encoder: SentenceEncoder, text: str) -> PromptQuery:
        # Two batches: padding the sentences to the whole prompt's length would encode it many times.
        parts = sentences(text)
        vectors = encoder.encode([text])
        if parts:
            vectors = torch.cat([vectors, encoder.encode(parts)])
        return cls(text, vectors)

    @property
    def whole(self) -> torch.Tensor:
        return self.vectors[0]

    def margin(self, row: int) -> float:
        """What a cosine reached through this row gives up (`SENTENCE_MARGIN` for a sentence)."""
        return 0.0 if row == 0 else SENTENCE_MARGIN

    def best(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For expert vectors [E, dim]: each one's best cosine less its row's margin [E], and the row."""
        margins = torch.full((self.vectors.shape[0],), SENTENCE_MARGIN)
        margins[0] = 0.0
        return (experts @ self.vectors.T - margins).max(dim=1)

    def source(self, row: int) -> str:
        return "whole prompt" if row == 0 else f"sentence {row}"


def words(text: str) -> tuple[str, ...]:
    return tuple(_WORD.findall(text.casefold()))


class KeywordIndex:
    """Which experts' keywords a prompt contains, as whole words: one lookup per n-gram of the prompt,
    so the cost follows the prompt's length, not the number of experts."""

    def __init__(self, keywords: Mapping[str, Sequence[str]]) -> None:
        self._experts: dict[tuple[str, ...], list[tuple[str, str]]] = {}
        for name, listed in keywords.items():
            for keyword in listed:
                key = words(keyword)
                if key:
                    self._experts.setdefault(key, []).append((name, keyword))
        self._longest = max(map(len, self._experts), default=0)

    def matches(self, text: str) -> dict[str, str]:
        """Expert name -> the first of its keywords found in `text`."""
        found: dict[str, str] = {}
        if not self._longest:
            return found
        tokens = words(text)
        for start in range(len(tokens)):
            for length in range(1, min(self._longest, len(tokens) - start) + 1):
                for name, keyword in self._experts.get(tokens[start : start + length], ()):
                    found.setdefault(name, keyword)
        return found


def topic_probes(keywords: Sequence[str]) -> list[str]:
    """Questions about an expert's subject that are not tasks for it."""
    return [template.format(k) for k in keywords[:PROBED_KEYWORDS] for template in TOPIC_TEMPLATES]
