"""A demo skill: a seeded generator of prompt/completion pairs and the metric that scores an answer.

Every demo expert is trained on one skill. A skill makes its data procedurally from a seed (nothing
is downloaded), so the same seed gives the same samples on every machine; `splits` draws the held-out
test split first and keeps every one of its prompts out of the training data.
"""

from __future__ import annotations

import json
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Example:
    """One sample: the user's prompt, the answer the expert is trained to give, and what the metric
    compares an answer with (`reference`, the completion's meaning)."""

    prompt: str
    completion: str
    reference: Any

    def to_json(self) -> dict[str, str]:
        return {"prompt": self.prompt, "completion": self.completion}


class Skill(ABC):
    """What one demo expert learns. Subclasses set the class attributes and implement `example`
    (one random sample) and `score` (an answer's score in [0, 1] against a sample)."""

    name: ClassVar[str]  # the expert's name
    description: ClassVar[str]  # the manifest's description: what a user would say the expert does
    keywords: ClassVar[tuple[str, ...]]
    adapter: ClassVar[str]  # "lora", "ia3" or "prompt-tuning" (expertctl expert train --type)
    metric: ClassVar[str]  # how `score` judges, in a few words, for the report
    max_new_tokens: ClassVar[int]  # enough for any correct answer

    @property
    def data_name(self) -> str:
        """What seeds the generator: skills that share it draw the same prompts."""
        return self.name

    @abstractmethod
    def example(self, rng: random.Random) -> Example:
        """One random sample."""

    @abstractmethod
    def score(self, output: str, example: Example) -> float:
        """How right `output` is for `example`, in [0, 1]."""

    def splits(self, seed: int, num_train: int, num_test: int) -> tuple[list[Example], list[Example]]:
        """(train, test): `num_test` distinct samples first, then `num_train` distinct samples whose
        prompts are none of the test prompts. Raises ValueError when the generator cannot make that
        many distinct prompts."""
        test = self._distinct(random.Random(f"{self.data_name}:test:{seed}"), num_test, set())
        train = self._distinct(
            random.Random(f"{self.data_name}:train:{seed}"), num_train, {e.prompt for e in test}
        )
        return train, test

    def _distinct(self, rng: random.Random, count: int, taken: set[str]) -> list[Example]:
        examples, seen = [], set(taken)
        for _ in range(count * 50):
            if len(examples) == count:
                return examples
            example = self.example(rng)
            if example.prompt not in seen:
                seen.add(example.prompt)
                examples.append(example)
        if len(examples) < count:
            raise ValueError(f"{self.name}: only {len(examples)} distinct prompts, {count} asked")
        return examples


# -- helpers the skills share --------------------------------------------------------------------------


def answer_line(output: str) -> str:
    """An answer as a short-answer metric reads it: its first non-empty line (an explanation after
    the answer is forgiven), stripped, without a final period or surrounding quotes or backticks."""
    lines = [line for line in output.splitlines() if line.strip()]
    text = (lines[0] if lines else "").strip().strip("`\"'").strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def first_json_object(text: str) -> dict | None:
    """The first JSON object in `text` (inside a code fence or prose around it), or None."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def join_words(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
