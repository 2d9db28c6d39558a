"""Date normalisation: a date written in one of many human styles, answered as ISO 8601.

Metric: exact match of the answer (stripped, without a final period) with YYYY-MM-DD, or
YYYY-MM-DDTHH:MM when the input has a time of day.
"""

from __future__ import annotations

import datetime as dt
import random

from tools.demo.skill import Example, Skill, answer_line

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")  # fmt: skip
PROMPTS = (
    "Normalize this date to ISO 8601 (YYYY-MM-DD): {d}",
    'Convert the date "{d}" to ISO 8601.',
    "Rewrite {d} in ISO format. Answer with the date only.",
    "ISO 8601 date for: {d}",
    "Turn this into a YYYY-MM-DD date: {d}",
)


class DateNormalisation(Skill):
    name = "date-normalize"
    description = (
        "Normalizes dates and times written in any style (March 5th, 2021; 05.03.2021; 3 pm) to ISO 8601."
    )
    keywords = ("date", "ISO 8601", "normalize dates", "date format", "timestamp")
    adapter = "lora"
    metric = "exact match"
    max_new_tokens = 24

    def example(self, rng: random.Random) -> Example:
        day = dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(365 * 90))
        text = _write_date(rng, day)
        answer = day.isoformat()
        if rng.random() < 0.3:
            hour, minute = rng.randrange(24), rng.choice((0, 5, 10, 15, 20, 30, 40, 45, 50))
            text += rng.choice((" at ", ", ")) + _write_time(rng, hour, minute)
            answer += f"T{hour:02d}:{minute:02d}"
        return Example(rng.choice(PROMPTS).format(d=text), answer, answer)

    def score(self, output: str, example: Example) -> float:
        return float(answer_line(output) == example.reference)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _write_date(rng: random.Random, d: dt.date) -> str:
    month = MONTHS[d.month - 1]
    styles = (
        f"{month} {d.day}, {d.year}",
        f"{month} {_ordinal(d.day)}, {d.year}",
        f"{d.day} {month} {d.year}",
        f"the {_ordinal(d.day)} of {month} {d.year}",
        f"{month[:3]} {d.day} {d.year}",
        f"{d.day:02d}.{d.month:02d}.{d.year}",
        f"{d.year}/{d.month:02d}/{d.day:02d}",
        f"{d.strftime('%A')}, {d.day} {month} {d.year}",
    )
    return rng.choice(styles)


def _write_time(rng: random.Random, hour: int, minute: int) -> str:
    if rng.random() < 0.5:
        return f"{hour:02d}:{minute:02d}"
    half = "am" if hour < 12 else "pm"
    twelve = hour % 12 or 12
    return f"{twelve}:{minute:02d} {half}" if minute else f"{twelve} {half}"
