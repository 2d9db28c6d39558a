"""The text fields of an HTTP request body. JSON may escape a lone surrogate (`"\ud800"`), which
Python decodes into a str that UTF-8, and so no protobuf string nor any later stage, can hold: such
a string is refused by field (400 naming it), like any other bad value, before anything encodes it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

INVALID_TEXT = "invalid_text"  # the validation error's type (errors.validation_error)


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            INVALID_TEXT,
            "not valid Unicode text: a lone surrogate (U+{code}) at character {at}",
            {"code": f"{ord(text[exc.start]):04X}", "at": exc.start},
        ) from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


def first_undecodable(value: object, path: str) -> str | None:
    """The path (`path.key[0]`) of the first string or key in a JSON value that UTF-8 cannot hold;
    None when there is none. For the free-form parts of a body (a response format's schema)."""
    if isinstance(value, str):
        return None if is_encodable(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not is_encodable(key):
                return path
            found = first_undecodable(item, f"{path}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = first_undecodable(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
