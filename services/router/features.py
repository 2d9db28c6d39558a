"""The fast prompt features (docs/design.md#prompt-features): language, JSON and code hints, task
type by patterns."""

from __future__ import annotations

import re
from dataclasses import dataclass

from langdetect import DetectorFactory, LangDetectException, detect

DetectorFactory.seed = 0  # langdetect is randomized; a fixed seed makes it a function of the text

CODE_KEYWORDS = ("function", "class", "import")

# Checked in order; the first pattern that matches names the task.
TASK_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "json_parsing",
        re.compile(r"\bjson\b|\bparse\b.*[{\[]|\bextract\b.*\bfields?\b", re.IGNORECASE | re.DOTALL),
    ),
    (
        "code_generation",
        re.compile(
            r"\b(write|implement|create|generate|fix|refactor)\b.*\b(function|class|method|code|script|program|"
            r"query|regex|sql|python|javascript|rust|java|bash)\b|```|\bdef \w+\(|\bSELECT\b.+\bFROM\b",
            re.IGNORECASE | re.DOTALL,
        ),
    ),
    (
        "creative_writing",
        re.compile(r"\b(story|poem|haiku|lyrics|novel|fairy tale|screenplay|limerick)\b", re.IGNORECASE),
    ),
    ("summarization", re.compile(r"\b(summari[sz]e|summary|tl;?dr|key points|in short)\b", re.IGNORECASE)),
    ("translation", re.compile(r"\btranslat(e|ion)\b", re.IGNORECASE)),
    (
        "question_answering",
        re.compile(r"\?\s*$|^\s*(what|who|when|where|why|how|which|is|are|does|do|can)\b", re.IGNORECASE),
    ),
)
TASK_TYPES = ("general", *(name for name, _ in TASK_PATTERNS))


@dataclass(frozen=True)
class Features:
    language: str
    has_json: bool
    has_code: bool
    task_type: str


def detect_language(text: str) -> str:
    """ISO 639-1 code of the text's language, or "unknown" when there is nothing to go on."""
    try:
        return detect(text)
    except LangDetectException:
        return "unknown"


def classify_task(prompt: str) -> str:
    for name, pattern in TASK_PATTERNS:
        if pattern.search(prompt):
            return name
    return "general"


def extract_features(prompt: str, body: str | None = None) -> Features:
    """The features of a prompt (its embedding comes with the expert index)."""
    lowered = prompt.lower()
    return Features(
        language=detect_language(prompt),
        has_json="{" in prompt or "json" in lowered,
        has_code=any(keyword in lowered for keyword in CODE_KEYWORDS),
        task_type=classify_task(prompt),
    )
