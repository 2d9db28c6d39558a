"""The fast prompt features (docs/design.md#prompt-features): language, JSON and code hints, task
type by patterns."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from py3langid.langid import MODEL_FILE, LanguageIdentifier

# Code as it is written, not words about it: "the function of the liver", "a classic", "important"
# and "import duties" are prose. Each alternative is a shape prose does not take.
CODE_SHAPES = re.compile(
    r"```"  # a fenced block
    r"|^[ \t]*(?:import|from)[ \t]+[\w.]+[ \t]*(?:$|[ \t]+(?:import|as)\b)"  # an import line
    r"|^[ \t]*#include[ \t]*[<\"]"  # a C include
    r"|\bdef[ \t]+\w+[ \t]*\("  # a Python function
    r"|\bfunction\b[ \t]*\w*[ \t]*\([^()\n]*\)[ \t]*\{"  # a JavaScript function
    r"|\bclass[ \t]+[A-Z]\w*[ \t]*(?:\([^()\n]*\))?[ \t]*[:{]"  # a class header
    r"|\b\w+\([^()\n]*\)[ \t]*\{|\([^()\n]*\)[ \t]*=>"  # a signature's body, an arrow function
    r"|;[ \t]*$",  # a statement's end
    re.MULTILINE,
)

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
# A request that constrains its output (docs/design.md#structured-output) is a structured task,
# whatever its prompt reads as: a JSON format is json_parsing's, a regex or a grammar is
# structured_output's, a task no prompt pattern names.
FORMAT_TASK_TYPES = {
    "json_object": "json_parsing",
    "json_schema": "json_parsing",
    "regex": "structured_output",
    "grammar": "structured_output",
}
TASK_TYPES = ("general", *(name for name, _ in TASK_PATTERNS), "structured_output")


@dataclass(frozen=True)
class Features:
    language: str
    has_json: bool
    has_code: bool
    task_type: str


# The language of a prompt (docs/design.md#prompt-features). A wrong language is worse than none: it
# adds a `language:<code>` candidate the prompt did not ask for, where "unknown" adds none (langdetect,
# which this replaces, called "Tell me a story" Italian and "Say hi" Somali). So a language is named
# only for a prompt of MIN_WORDS words or more to which py3langid gives MIN_CONFIDENCE or more.
# py3langid is langid.py's naive Bayes over byte n-grams, retrained on 139 languages; its model is in
# the wheel and it is deterministic. It divides its log-scores by the square root of the text's
# length, so short text scores low by itself; the word rule catches what it is still sure of in one
# or two words ("Hello there": Sotho, 0.34). Tuned on bench/data/language_prompts.json (251 short
# prompts of ours; bench/language.py prints the figures): 2 named wrong (0.8%; langdetect: 24%),
# 97% of the clear prompts named right. Just under 0.3 lie the last wrong names of 3 words or more
# (0.20: English for "npm install react"; 0.18: Nigerian Pidgin for "Python vs Rust?"); 0.4 would
# name 6 fewer right and no fewer wrong.
MIN_WORDS = 3
MIN_CONFIDENCE = 0.3
# Scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, kana, Han): each of their
# characters counts as a word.
_UNSPACED = re.compile(
    r"[\u0E00-\u0EFF\u1000-\u109F\u1780-\u17FF\u3040-\u30FF\u3400-\u4DBF\u4E00-\u9FFF\uF900-\uFAFF]"
)
# The model's varieties of one language count for it (py3langid splits Chinese into zh, wuu and yue,
# for one); "zxx" is its class for text in no language (numbers, markup, identifiers).
_FOLD = {"wuu": "zh", "yue": "zh", "ary": "ar", "arz": "ar", "uzs": "uz", "hbo": "he", "grc": "el"}
NO_LANGUAGE = "zxx"


@functools.cache
def language_model() -> LanguageIdentifier:
    """py3langid's model, loaded once (~0.7 s, ~70 MB; the router loads it at startup)."""
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


# The start of a long prompt tells its language as well as all of it; reading no more keeps a call
# at well under a millisecond whatever the prompt's size (it may be 500,000 characters).
LANGUAGE_SAMPLE_CHARS = 1000


def word_count(text: str) -> int:
    """Runs of non-spaces with a letter in them (in linear time: a regex for it backtracks on a long
    run without letters)."""
    spaced = _UNSPACED.sub(r" \g<0> ", text)
    return sum(1 for word in spaced.split() if any(c.isalpha() for c in word))


def language_scores(text: str) -> list[tuple[str, float]]:
    """The model's probability of each language for the text (varieties folded), best first."""
    scores: dict[str, float] = {}
    for code, probability in language_model().rank(text):
        code = _FOLD.get(code, code)
        scores[code] = scores.get(code, 0.0) + probability
    return sorted(scores.items(), key=lambda item: item[1], reverse=True)


def detect_language(text: str) -> str:
    """ISO 639-1 code of the text's language (ISO 639-3 for a language without one), or "unknown"
    when the text is too short or the model is not sure enough (see MIN_WORDS)."""
    text = text[:LANGUAGE_SAMPLE_CHARS]
    if word_count(text) < MIN_WORDS:
        return "unknown"
    code, confidence = language_scores(text)[0]
    if code == NO_LANGUAGE or confidence < MIN_CONFIDENCE:
        return "unknown"
    return code


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
        has_code=CODE_SHAPES.search(prompt) is not None,
        task_type=classify_task(prompt),
    )


def for_format(features: Features, format_kind: str | None) -> Features:
    """The features of a request whose output has a format of this kind (None: no format): the
    format's task type in place of the prompt's."""
    if format_kind is None:
        return features
    return dataclasses.replace(features, task_type=FORMAT_TASK_TYPES[format_kind])
