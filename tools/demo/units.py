"""Unit conversion between metric units that differ by a power of ten.

Metric: exact match of the answer (stripped, without a final period) with "<number> <unit>", the
number written without trailing zeros.
"""

from __future__ import annotations

import random
from decimal import Decimal

from tools.demo.skill import Example, Skill, answer_line

# (unit, unit, how many of the second make one of the first)
PAIRS = (
    ("km", "m", 1000), ("m", "cm", 100), ("cm", "mm", 10), ("m", "mm", 1000),
    ("kg", "g", 1000), ("g", "mg", 1000), ("L", "mL", 1000), ("t", "kg", 1000),
    ("km", "cm", 100000), ("kW", "W", 1000), ("MB", "kB", 1000), ("s", "ms", 1000),
)  # fmt: skip
PROMPTS = (
    "Convert {q} to {u}.",
    "How many {u} is {q}? Answer with the number and unit.",
    "{q} in {u} = ?",
    "Express {q} in {u}.",
    "Unit conversion: {q} -> {u}",
)


class UnitConversion(Skill):
    name = "unit-convert"
    description = (
        "Converts quantities between metric units (km, m, cm, mm, kg, g, mg, L, mL, W, kW, ms) exactly."
    )
    keywords = ("unit conversion", "metric units", "convert units", "kilometers to meters", "measurements")
    adapter = "lora"
    metric = "exact match"
    max_new_tokens = 16

    def example(self, rng: random.Random) -> Example:
        big, small, factor = rng.choice(PAIRS)
        value = _number(rng)
        if rng.random() < 0.5:
            source, target, result = (value, big), small, value * factor
        else:
            source, target, result = (value, small), big, value / factor
        answer = f"{_plain(result)} {target}"
        prompt = rng.choice(PROMPTS).format(q=f"{_plain(source[0])} {source[1]}", u=target)
        return Example(prompt, answer, answer)

    def score(self, output: str, example: Example) -> float:
        return float(answer_line(output) == example.reference)


def _number(rng: random.Random) -> Decimal:
    kind = rng.random()
    if kind < 0.5:
        return Decimal(rng.randint(1, 999))
    if kind < 0.8:
        return Decimal(rng.randint(1, 999)) / 10
    return Decimal(rng.randint(1, 9999)) / 100


def _plain(value: Decimal) -> str:
    """A decimal without exponent or trailing zeros: 3500, 0.25, 12.5."""
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
