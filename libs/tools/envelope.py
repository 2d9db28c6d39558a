"""One call's JSON envelope (`{"name": ..., "arguments": {...}}`), scanned character by character
as the model writes it: where each top-level value starts and ends, so that the call's name is
known as soon as its string closes and its arguments can be sent as they grow (libs/tools/
streaming.py). Only the structure is tracked (depth, strings, escapes); the values are left as the
model wrote them, so the pieces sent add up to exactly the text of the arguments."""

from __future__ import annotations


class Envelope:
    """The scan of one envelope, which starts at its `{`. `spans` maps each top-level key whose
    value is complete to the value's [start, end) in the text; `open_key` and `open_start` name the
    value being read (None when none is)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.expect_key = True  # at the top level: a key comes next (else its value)
        self.token_start: int | None = None  # the top-level key string or value being read
        self.key: str | None = None
        self.spans: dict[str, tuple[int, int]] = {}
        self.done = False

    @property
    def open_key(self) -> str | None:
        return self.key if not self.expect_key and self.token_start is not None else None

    def scan(self, text: str, start: int) -> int:
        """Read `text` from `start`; the position after the envelope's closing brace once it is
        done, else the text's end."""
        for i in range(start, len(text)):
            self._step(text, i)
            if self.done:
                return i + 1
        return len(text)

    def _step(self, text: str, i: int) -> None:
        c = text[i]
        if self.in_string:
            self._string_char(text, i)
        elif c == '"':
            self.in_string = True
            self._begin(i)
        elif c in "{[":
            self._begin(i)
            self.depth += 1
        elif c in "}]":
            self._close(i)
        elif self.depth == 1:
            self._top_level(c, i)

    def _string_char(self, text: str, i: int) -> None:
        if self.escaped:
            self.escaped = False
        elif text[i] == "\\":
            self.escaped = True
        elif text[i] == '"':
            self.in_string = False
            if self.depth == 1:
                self._end_token(text, i + 1)

    def _begin(self, i: int) -> None:
        """A string or container starts: at the top level, a key's or a value's start."""
        if self.depth == 1 and self.token_start is None:
            self.token_start = i

    def _close(self, i: int) -> None:
        if self.depth == 1:  # the envelope's own brace: a literal value before it ends there
            self._end_literal(i)
            self.done = True
        self.depth -= 1
        if self.depth == 1:  # a container value ends
            self._end_token(None, i + 1)

    def _top_level(self, c: str, i: int) -> None:
        if c == ":":
            self.expect_key = False
        elif c == ",":
            self._end_literal(i)
            self.expect_key = True
        elif c.isspace():
            self._end_literal(i)
        elif self.token_start is None:  # a number, true, false or null
            self.token_start = i

    def _end_literal(self, end: int) -> None:
        if self.token_start is not None and not self.expect_key:
            self._end_token(None, end)

    def _end_token(self, text: str | None, end: int) -> None:
        start, self.token_start = self.token_start, None
        if start is None:
            return
        if self.expect_key:
            self.key = text[start + 1 : end - 1] if text is not None else None
        elif self.key is not None:
            self.spans[self.key] = (start, end)
            self.key = None
