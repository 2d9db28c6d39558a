"""How a prompt is compared with an expert, beyond one cosine of two embeddings.

Retrieval (the experts nearest the prompt's embedding, k = 30, each above a floor) is kept;
four rules decide what "nearest" means, each measured on the routing benchmark (`docs/experts.md`):

- **Sentences.** A request often wraps its task in context ("We moved offices last week. Convert
  12 miles to km."), and one embedding of the whole dilutes the task. The prompt is encoded whole and
  sentence by sentence (up to `MAX_SENTENCES` of at least `MIN_SENTENCE_CHARS` characters); an
  expert's similarity is the best of them, a sentence's less `SENTENCE_MARGIN`: every sentence is
  one more draw against a floor calibrated for one embedding per prompt, and without the margin the
  context sentences of a prompt ("Contact: ana@example.com.") bring in experts it does not need.
- **The request without its material.** A prompt often pastes what the task works on after its
  request ("Could you boil this down to the essentials?\n\n<an article>", "Is this review good or
  bad? '<the review>'"), and the material outweighs the request in the embedding. The request alone
  (`instruction`: the leading paragraph, or the text up to a line ending with a colon, with long
  quotations replaced by "this text") is encoded too and counts like the whole prompt, with no margin:
  it is the prompt, less what the task is applied to.
- **The author's words.** Each word of the prompt that also appears in the expert's description or
  keywords adds `word_weight` times the word's inverse document frequency over every expert's
  description and keywords and a corpus of generic prompts (`AuthorWords`): "[PHONE]" or "redact"
  say much, "email" (in three experts' descriptions and in everyday questions) little, "please"
  nothing. Words are compared by stem, with British spellings folded into American ones.
- **Topic gate.** A question about an expert's subject ("Who invented regular expressions?") is as
  close to the expert as a task for it. At registration each expert with keywords gets topic probes:
  small-talk questions about each of its first `PROBED_KEYWORDS` keywords (`topic_probes`). An
  expert is not taken when the whole prompt is at least as similar to its nearest probe as to the
  expert and to each text the expert is known by (its description, keywords line and examples),
  unless the prompt carries material for a request (a question about a subject has none): a
  keyword that is itself a task ("kilometers to meters") makes probes that resemble tasks, and the
  expert's examples of such tasks resemble them more.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import snowballstemmer
import torch

from services.router.embedding import SentenceEncoder

MAX_SENTENCES = 8
MIN_SENTENCE_CHARS = 8
SENTENCE_MARGIN = 0.08
_SENTENCE_END = re.compile(r"(?<=[.!?:])\s+|\n+")
# The request ends at its first blank line, or at a line break after a colon ("Summarise this:\n...").
_REQUEST_END = re.compile(r"\n\s*\n|(?<=:)[ \t]*\n")
# A quotation of at least 12 characters, opened after a space, a colon or a parenthesis (so that an
# apostrophe in "candidate's" opens none) and closed before punctuation, a space or the end.
_QUOTATION = re.compile(r"(?:(?<=[\s:(])|^)'[^\n]{12,}?'(?=[\s.,!?;)]|$)|\"[^\"]{12,}\"|“[^”]{12,}”")
# A word, or a placeholder in brackets ("[EMAIL]", kept apart from "email").
_WORD = re.compile(r"\[\w+\]|\w+")
_BRITISH = re.compile(r"is(e|es|ed|ing|ation|ations)$")  # summarise -> summarize, before stemming
_STOP_WORDS = frozenset(
    ("a", "an", "the", "and", "or", "of", "to", "in", "on", "for", "with", "this", "that", "these",
     "those", "is", "are", "was", "be", "it", "its", "my", "me", "i", "you", "your", "can", "could",
     "would", "please", "what", "how", "do", "does", "at", "by", "from", "as", "into", "about")
)  # fmt: skip

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
    """The tunable parts: the weight of the author's words (0 turns them off), whether the topic gate
    applies, and the
    companion ratio: selection composes a non-forced expert with the leading one only when its
    similarity is at least this share of the leader's (0 composes every candidate, as the original
    design did)."""

    word_weight: float = 0.0125
    topic_gate: bool = True
    companion_ratio: float = 0.5

    def describe(self) -> str:
        return (
            f"author's words x {self.word_weight:g} idf, topic gate {'on' if self.topic_gate else 'off'}, "
            f"companions >= {self.companion_ratio:g} x the leader's similarity"
        )


DEFAULT_MATCHING = MatchRule()


def sentences(text: str) -> list[str]:
    """The prompt's sentences worth encoding apart: none when it has only one."""
    parts = [p.strip() for p in _SENTENCE_END.split(text)]
    parts = [p for p in parts if len(p) >= MIN_SENTENCE_CHARS]
    return parts[:MAX_SENTENCES] if len(parts) > 1 else []


def instruction(text: str) -> str | None:
    """The request without the material it is applied to, when the prompt carries some: its leading
    paragraph (or the text up to a line ending with a colon) with long quotations replaced by "this
    text". None when that is the whole prompt, or too short to stand alone."""
    text = text.strip()
    request = _QUOTATION.sub("this text", _REQUEST_END.split(text, maxsplit=1)[0]).strip()
    return request if request != text and len(request) >= MIN_SENTENCE_CHARS else None


@dataclass(frozen=True)
class PromptQuery:
    """A prompt as retrieval sees it: its text and its embeddings. The first `num_requests` rows are
    the whole prompt and, when the prompt carries material, its request alone (`instruction`); one row
    per sentence follows."""

    text: str
    vectors: torch.Tensor  # [requests + sentences, dim], unit rows
    num_requests: int = 1

    @classmethod
    def encode(cls, encoder: SentenceEncoder, text: str) -> PromptQuery:
        # The whole prompt with its request, then the sentences: padding the sentences to the whole
        # prompt's length would encode it many times.
        request = instruction(text)
        requests = [text] if request is None else [text, request]
        vectors = encoder.encode(requests)
        parts = sentences(text)
        if parts:
            vectors = torch.cat([vectors, encoder.encode(parts)])
        return cls(text, vectors, len(requests))

    @property
    def whole(self) -> torch.Tensor:
        return self.vectors[0]

    @property
    def carries_material(self) -> bool:
        """Whether the prompt pastes or quotes what its request applies to (it has a request row)."""
        return self.num_requests > 1

    def margin(self, row: int) -> float:
        """What a cosine reached through this row gives up (`SENTENCE_MARGIN` for a sentence)."""
        return 0.0 if row < self.num_requests else SENTENCE_MARGIN

    def best(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For expert vectors [E, dim]: each one's best cosine less its row's margin [E], and the row."""
        margins = torch.full((self.vectors.shape[0],), SENTENCE_MARGIN)
        margins[: self.num_requests] = 0.0
        return (experts @ self.vectors.T - margins).max(dim=1)

    def source(self, row: int) -> str:
        if row == 0:
            return "whole prompt"
        return "request" if row < self.num_requests else f"sentence {row - self.num_requests + 1}"


_STEMMER = snowballstemmer.stemmer("english")


def stems(text: str) -> frozenset[str]:
    """The distinct stems of a text's words, less stop words, numbers and single letters."""
    words = (w for w in _WORD.findall(text.casefold()) if w not in _STOP_WORDS and len(w.strip("[]")) > 1)
    return frozenset(_STEMMER.stemWord(_BRITISH.sub(r"iz\1", w)) for w in words if not w.isdigit())


@dataclass(frozen=True)
class WordMatch:
    """The prompt's words found among an expert's own, and their summed inverse document frequency."""

    words: tuple[str, ...]  # stems, rarest first
    weight: float


class AuthorWords:
    """Which of the prompt's words each expert's author used (in its description or keywords),
    weighted by rarity: a word's inverse document frequency is ln(N / n) over N documents, every
    expert's description and keywords and every prompt of a generic corpus, n of which contain it.
    One lookup per word of the prompt, so the cost follows the prompt, not the number of experts."""

    def __init__(self, experts: Mapping[str, str], generic: Iterable[frozenset[str]]) -> None:
        self._experts: dict[str, list[str]] = {}  # stem -> the experts whose text has it
        for name, text in experts.items():
            for stem in stems(text):
                self._experts.setdefault(stem, []).append(name)
        counts = {stem: len(names) for stem, names in self._experts.items()}
        documents = len(experts)
        for document in generic:
            documents += 1
            for stem in document & counts.keys():
                counts[stem] += 1
        self._idf = {stem: math.log(documents / n) for stem, n in counts.items()}

    def matches(self, text: str) -> dict[str, WordMatch]:
        """Expert name -> the prompt's words in its author's text (experts with none are left out)."""
        found: dict[str, list[str]] = {}
        for stem in stems(text):
            for name in self._experts.get(stem, ()):
                found.setdefault(name, []).append(stem)
        return {
            name: WordMatch(
                tuple(sorted(words, key=lambda w: (-self._idf[w], w))), sum(self._idf[w] for w in words)
            )
            for name, words in found.items()
        }


def author_text(description: str, keywords: Sequence[str]) -> str:
    """What the author wrote about an expert: the text its words are taken from."""
    return " ".join([description, *keywords])


def topic_probes(keywords: Sequence[str]) -> list[str]:
    """Questions about an expert's subject that are not tasks for it."""
    return [template.format(k) for k in keywords[:PROBED_KEYWORDS] for template in TOPIC_TEMPLATES]
