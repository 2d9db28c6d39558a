"""libs.training.data.parse_bytes, what uploads are checked with: lines end at "\\n" only (a JSON string
may hold U+2028 raw), a byte order mark is skipped, and bytes that are not UTF-8 are refused."""

from __future__ import annotations

import json

import pytest

from libs.training.data import DataError, parse_bytes


def test_lines_are_counted_at_newlines_only():
    separated = json.dumps({"prompt": "a\u2028b", "completion": "c"}, ensure_ascii=False).encode()
    content = b"\xef\xbb\xbf" + separated + b"\r\n\n" + b'{"prompt": "x"}\n'
    with pytest.raises(DataError, match=r"^up\.jsonl:3: completion: missing$"):
        parse_bytes(content, "up.jsonl")
    samples = parse_bytes(content.rsplit(b"\n", 2)[0], "up.jsonl")
    assert [s.prompt for s in samples] == ["a\u2028b"] and samples[0].source == "up.jsonl:1"


def test_bytes_that_are_not_utf8_or_hold_no_sample_are_refused():
    with pytest.raises(DataError, match=r"^up\.jsonl:2: not UTF-8 text \(at byte offset 14\)$"):
        parse_bytes(b'\n{"prompt": "a\xff"}', "up.jsonl")
    with pytest.raises(DataError, match="holds no samples"):
        parse_bytes(b"\n  \n", "up.jsonl")
