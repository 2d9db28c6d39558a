"""Training data: a JSONL file of samples, each one conversation whose assistant turns are learned.

A line is `{"prompt": ..., "completion": ...}` (a user turn and the answer) or `{"messages": [{"role",
"content"}, ...]}` (a whole conversation; every assistant turn is learned, and the last message must
be one). Every problem is a `DataError` naming the file, the line and the field, and the whole file is
checked before anything is trained or written. A line nested past Python's recursion limit, or a
string holding a lone surrogate (`"\ud800"`, which no tokenizer nor UTF-8 encoder takes), is refused
like any other bad line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.utf8 import undecodable

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """Training data that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Sample:
    """One training conversation and where it came from (`source` is "FILE:LINE")."""

    messages: tuple[dict[str, str], ...]
    source: str

    @property
    def prompt(self) -> str:
        """The first user turn: what routing knows the expert by."""
        return next(m["content"] for m in self.messages if m["role"] == "user")


def read_jsonl(path: str | Path) -> list[Sample]:
    """Every sample of the JSONL file `path` (blank lines are skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None
    samples = list(parse_lines(text.splitlines(), str(path)))
    if not samples:
        raise DataError(f"{path}: holds no samples")
    return samples


def parse_bytes(content: bytes, name: str) -> list[Sample]:
    """Every sample of JSONL `content` (an upload, a stored training file) called `name` in errors."""
    try:
        text = content.decode("utf-8-sig")  # a byte order mark is no part of the first line
    except UnicodeDecodeError as exc:
        line = content.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{name}:{line}: not UTF-8 text (at byte offset {exc.start})") from None
    # Lines end at "\n" only (a "\r" before it is JSON whitespace): splitlines() would also cut at
    # U+2028 and the like, which JSON strings may hold raw, and miscount the lines after them.
    samples = list(parse_lines(text.split("\n"), name))
    if not samples:
        raise DataError(f"{name}: holds no samples")
    return samples


def parse_lines(lines: Iterable[str], name: str) -> Iterable[Sample]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{where}: not valid JSON ({exc})") from None
        except RecursionError:
            # A sample is at most three levels deep ({"messages": [{"role", "content"}]}).
            raise DataError(f"{where}: nested too deeply to be a sample") from None
        bad_text = undecodable(record, "")
        if bad_text is not None:  # before any message quotes the line's text
            field, problem = bad_text
            raise DataError(f"{where}: {field + ': ' if field else ''}{problem}")
        yield Sample(_messages(record, where), where)


def _messages(record: object, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with prompt/completion or messages")
    if "messages" in record:
        extra = sorted(set(record) - {"messages"})
        if extra:
            raise DataError(f"{where}: {extra[0]}: not expected beside messages")
        return _conversation(record["messages"], where)
    extra = sorted(set(record) - {"prompt", "completion"})
    if extra:
        raise DataError(f"{where}: {extra[0]}: unknown field (expected prompt and completion, or messages)")
    for key in ("prompt", "completion"):
        if key not in record:
            raise DataError(f"{where}: {key}: missing")
        _check_text(record[key], key, where)
    if not record["prompt"].strip():
        raise DataError(f"{where}: prompt: must not be empty")
    if not record["completion"].strip():
        raise DataError(f"{where}: completion: must not be empty")
    return (
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    )


def _conversation(messages: object, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages: must be a non-empty list")
    checked = [_message(message, f"messages[{i}]", where) for i, message in enumerate(messages)]
    if checked[0]["role"] == "assistant":
        raise DataError(f"{where}: messages[0].role: a conversation cannot open with the assistant")
    if checked[-1]["role"] != "assistant":
        raise DataError(f"{where}: messages: the last message must be the assistant's (what is learned)")
    if not any(m["role"] == "user" for m in checked):
        raise DataError(f"{where}: messages: no user turn")
    return tuple(checked)


def _message(message: object, field: str, where: str) -> dict[str, str]:
    """One message of a conversation: a role and its text (an assistant turn not empty)."""
    if not isinstance(message, dict):
        raise DataError(f"{where}: {field}: must be an object with role and content")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise DataError(f"{where}: {field}.{extra[0]}: unknown field (expected role and content)")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        shown = repr(role[:32]) if isinstance(role, str) else f"a {type(role).__name__}"
        raise DataError(f"{where}: {field}.role: must be one of {', '.join(ROLES)}, got {shown}")
    if content is None:
        raise DataError(f"{where}: {field}.content: missing")
    _check_text(content, f"{field}.content", where)
    if role == "assistant" and not content.strip():
        raise DataError(f"{where}: {field}.content: an assistant turn must not be empty")
    return {"role": role, "content": content}


def _check_text(value: object, field: str, where: str) -> None:
    if not isinstance(value, str):
        raise DataError(f"{where}: {field}: must be a string")
