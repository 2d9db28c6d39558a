"""The JSON the package format writes and accepts.

Written JSON is canonical (sorted keys, two-space indent, UTF-8, one trailing newline) so that the
same content always has the same bytes, hence the same checksum. Read JSON is strict: duplicate keys
and the non-standard NaN/Infinity constants are refused, because a signed file must mean one thing
to every reader.
"""

from __future__ import annotations

import json
from typing import Any


def dumps_canonical(value: Any) -> bytes:
    """`value` as canonical JSON bytes: sorted keys, indent 2, UTF-8, a trailing newline."""
    return (json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def loads_strict(data: bytes) -> Any:
    """Parse UTF-8 JSON, refusing duplicate keys and NaN/Infinity; raises ValueError saying why."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
