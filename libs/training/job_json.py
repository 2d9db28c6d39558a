"""The JSON of a training job's record (libs.training.jobs): written only as JSON can be (a number it
cannot write, such as the NaN loss of a diverged run, as null), and read back leniently, so that a
record written before that rule held still reads (its bad numbers and its text that UTF-8 cannot hold
as absent) instead of failing every listing of its owner's jobs."""

from __future__ import annotations

import json
import math
from typing import Any

from libs.utf8 import first_undecodable


def _finite(value: Any) -> Any:
    """`value` with every number JSON cannot write (NaN, ±inf) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """The JSON of what the trainer reports (metrics, checkpoints, events), numbers JSON cannot write
    as null."""
    return json.dumps(_finite(value), allow_nan=False)


def _finite_float(text: str) -> float | None:
    number = float(text)  # "1e400" reads as inf
    return number if math.isfinite(number) else None


def read_json(text: str) -> Any:
    """A stored JSON field, read leniently: NaN and out-of-range numbers (stored before they were
    refused) as None; a value holding text UTF-8 cannot hold, or no JSON at all, as None."""
    try:
        value = json.loads(text, parse_constant=lambda _: None, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None
    return None if first_undecodable(value, "") is not None else value


def as_object(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None
