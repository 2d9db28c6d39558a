"""Errors the engine raises for bad input: each names the offending field."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or sampling parameter that cannot be served; `field` names what to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message
