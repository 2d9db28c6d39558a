"""A clock tests move by hand, for code that takes a `clock` callable."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
