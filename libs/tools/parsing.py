"""Tool calls read out of a finished output, in its family's format (as vLLM's tool parsers do).

An output is calls only when it starts the way a call starts and is nothing but well-formed calls
(one cut short by max_tokens: the complete calls before the unfinished one); anything else is
text. Under `required` or a named function the grammar leaves no other outcome than calls.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from libs.tools.families import ToolFamily

_HERMES_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.DOTALL)
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedCall:
    name: str
    # The arguments as JSON text (an object).
    arguments: str


def new_call_id() -> str:
    """OpenAI's shape of a call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def parse_calls(family: ToolFamily, text: str, *, cut: bool = False) -> list[ParsedCall] | None:
    """The calls `text` consists of, or None when it is not calls. A text `cut` short (by
    max_tokens) keeps the complete calls before its unfinished one, as vLLM's parsers do; cut
    inside its first call, it is text."""
    if not text.startswith(family.call_start):
        return None
    hermes = family.format == "hermes"
    documents = _hermes_documents(text, cut) if hermes else _json_documents(text, ";", cut)
    if not documents:
        return None
    calls = [_call(document, family) for document in documents]
    return None if any(call is None for call in calls) else calls


def _hermes_documents(text: str, cut: bool) -> list[str] | None:
    documents, position = [], 0
    while position < len(text):
        block = _HERMES_BLOCK.match(text, position)
        if block is None:
            return documents if cut else None
        documents.append(block.group(1))
        position = block.end()
    return documents


def _json_documents(text: str, separator: str, cut: bool) -> list[str] | None:
    """Consecutive JSON objects, separated by `separator` and whitespace."""
    decoder, documents, position = json.JSONDecoder(), [], 0
    while True:
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return documents if cut else None
        documents.append(text[position:end])
        rest = text[end:].lstrip()
        if not rest:
            return documents
        if not rest.startswith(separator):
            return None
        position = len(text) - len(rest[1:].lstrip())


def _call(document: str, family: ToolFamily) -> ParsedCall | None:
    try:
        value = json.loads(document)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if family.format == "hermes" else "parameters"
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
