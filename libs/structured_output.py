"""Structured output formats (docs/design.md#structured-output): what a request may constrain its
output to, and the one translation of each into an llguidance grammar.

Reception checks a format with `format_problem` before a job is queued, the engine compiles
`grammar_text` into a token matcher, and postproc checks a finished text with `text_problem`. All
three use this module, so a format means the same thing at every stage. It needs no model: the
checks here run without a tokenizer (postproc's reads the text byte by byte).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Literal

import llguidance

# The cap on a request's format: the schema's, regex's or grammar's UTF-8 bytes (a format is a
# constraint, not content; the cap bounds the engine's work to compile it).
MAX_FORMAT_BYTES = 16 * 1024

Kind = Literal["json_object", "json_schema", "regex", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "grammar")

# How JSON is written under a schema. Whitespace stays flexible so that any document the schema
# accepts can be generated (a model that writes `{"a": 1}` is not pushed to `{"a":1}`), but a run of
# it is bounded: an unbounded run is what a small model falls into when it hesitates, and it then
# pads with newlines to max_tokens.
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}

_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output.

    kind: json_object (any JSON object), json_schema (`spec` is the schema as JSON text), regex
    (`spec` is a regular expression the whole output matches, in Rust's regex syntax without
    look-around or backreferences), grammar (`spec` is a grammar in llguidance's Lark dialect).
    """

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}")

    @property
    def key(self) -> str:
        """A content hash: equal formats share one compiled grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_object", "json_schema")

    @property
    def schema_text(self) -> str | None:
        """The JSON schema the output must satisfy (json kinds), else None."""
        if self.kind == "json_object":
            return _ANY_OBJECT
        return self.spec if self.kind == "json_schema" else None


def grammar_text(output: StructuredOutput) -> str:
    """The llguidance grammar of a format (ValueError when a schema is not a JSON object)."""
    if output.is_json:
        try:
            schema = json.loads(output.schema_text)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not isinstance(schema, dict):
            raise ValueError(f"expected an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(only_declared(schema), defaults=JSON_OPTIONS)
    if output.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(output.spec)
    return llguidance.LLMatcher.grammar_from_lark(output.spec)


def only_declared(schema: dict) -> dict:
    """`schema`, changed in place so that an object that declares its properties and says nothing of others
    has no others (`additionalProperties: false`), as xgrammar's strict mode and OpenAI's strict
    schemas have it. JSON Schema would allow any extra property there, and a small model given that
    freedom invents properties until max_tokens. Every document generated this way still satisfies
    the original schema. The parts of an `allOf` are left open, since each may declare properties
    the others add. Only subschemas are visited (never `enum` or `const` values), with a stack, so
    no depth can exhaust the recursion limit."""
    stack: list[tuple[object, bool]] = [(schema, True)]
    while stack:
        node, close = stack.pop()
        if not isinstance(node, dict):
            continue
        if close and isinstance(node.get("properties"), dict) and not _OTHER_PROPERTIES & node.keys():
            node["additionalProperties"] = False
        for key in _SUBSCHEMA:
            if key in node:
                stack.append((node[key], True))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((part, key != "allOf") for part in node[key])
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((part, True) for part in node[key].values())
    return schema


_OTHER_PROPERTIES = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
_SUBSCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "if", "then", "else", "not")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def format_problem(output: StructuredOutput, max_bytes: int = MAX_FORMAT_BYTES) -> str | None:
    """Why a format cannot be enforced (too long, not a schema, a regex or grammar that does not
    compile, a schema keyword the library does not implement), or None. Schema keywords are never
    ignored: llguidance refuses what it cannot enforce, and so does this check."""
    size = len(output.spec.encode())
    if size > max_bytes:
        return f"at most {max_bytes} bytes, got {size}"
    if output.kind in ("regex", "grammar") and not output.spec:
        return "must not be empty"
    try:
        grammar = grammar_text(output)
    except ValueError as exc:  # json.JSONDecodeError included
        return f"not a JSON schema object: {exc}"
    # Compiled once, over bytes: the compile refuses what llguidance cannot enforce, and the first
    # mask finds what shows only once the parser runs, such as a grammar whose start rule can never
    # end (`start: start`), under which no text at all can be generated.
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        return error_reason(matcher.get_error())
    matcher.compute_bitmask()
    if matcher.is_error():
        reason = matcher.get_error().split("<state>")[0].strip()  # the parser's state dump follows
        return (
            error_reason(reason)
            if " " in reason
            else f"no output can be generated under it (llguidance: {reason})"
        )
    return None


def text_problem(output: StructuredOutput, text: str) -> str | None:
    """Why `text` is not an output of the format (the bytes that stop matching, or an end that
    comes too early), or None when it matches it whole. Independent of any model's tokens: the
    text is fed to the grammar one byte at a time."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar_text(output), log_level=0)
    if matcher.is_error():
        return error_reason(matcher.get_error())
    data = text.encode()
    accepted = matcher.try_consume_tokens(list(data))
    if accepted < len(data):
        return f"does not match from byte {accepted}: {_excerpt(data[accepted:])}"
    if not matcher.is_accepting():
        return "ends before the format is complete"
    return None


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, plus an end token: llguidance's view of text."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]
        self.tokens = [bytes([b]) for b in range(256)] + [b"<end>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


# llguidance quotes the refused text before its reason (`invalid regex "<the regex>" ... error:
# look-around ... is not supported 1 | start: /<the regex>/`): the reason goes first, so that a
# message clipped here, or on the wire (a gRPC field violation keeps 192 bytes), still says it.
# The last "error: " is the reason's ("regex parse error: <the regex> ^^^ error: <reason>").
_REASON = re.compile(r"(.+)\berror: (.+?)(?: \d+ \| .*)?$")


def error_reason(message: str) -> str:
    """An llguidance error on one line, its reason first (before the compiler's position)."""
    text = " ".join(message.split())
    found = _REASON.fullmatch(text)
    if found is not None:
        text = f"{found.group(2)} ({found.group(1).strip()})"
    return text[:400]


def _excerpt(data: bytes) -> str:
    return json.dumps(data[:40].decode(errors="replace"))
