"""The text of an HTTP request body. JSON may escape a lone surrogate (`"\ud800"`), which Python
decodes into a str that UTF-8, and so no protobuf string nor any later stage, can hold. The rule is
libs/utf8.py's; every JSON body is walked whole against it once, before a route reads a field
(text_guard.py), so the body models need no text type of their own."""

from __future__ import annotations

from libs.utf8 import first_undecodable, is_encodable

__all__ = ["INVALID_TEXT", "first_undecodable", "is_encodable"]

INVALID_TEXT = "invalid_text"  # the validation error's type of such text (errors.validation_error)
