"""docs/api.md documents the whole gRPC API: every service's RPCs, every message's fields, every
enum's values, read from the generated descriptors (so a field added to a proto without its line in
the docs fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from libs.gen.expert.v1 import (
    common_pb2,
    engine_pb2,
    files_pb2,
    inference_pb2,
    keys_pb2,
    postproc_pb2,
    preparation_pb2,
    router_pb2,
    session_pb2,
    training_pb2,
)

API = (Path(__file__).resolve().parents[2] / "docs/api.md").read_text()
FILES = [
    m.DESCRIPTOR
    for m in (
        common_pb2,
        inference_pb2,
        keys_pb2,
        session_pb2,
        training_pb2,
        files_pb2,
        router_pb2,
        preparation_pb2,
        engine_pb2,
        postproc_pb2,
    )
]
MESSAGES = {name: message for f in FILES for name, message in f.message_types_by_name.items()}
_HEADING = re.compile(r"#+ `(\w+)`")
_CELL = re.compile(r"`([^`]+)`")


def _documented_fields() -> set[tuple[str, str]]:
    """(message, field) pairs the docs list: rows of a table under a "#### `Message`" heading, and
    rows of a shared table that start with "| `Message`[, `Other`] | `field` |"."""
    pairs, current = set(), None
    for line in API.splitlines():
        if line.startswith("#"):
            heading = _HEADING.fullmatch(line)
            current = heading.group(1) if heading and heading.group(1) in MESSAGES else None
            continue
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        owners = [name for name in _CELL.findall(cells[0]) if name in MESSAGES]
        if owners and len(cells) > 1 and _CELL.fullmatch(cells[1]):
            pairs.update((owner, _CELL.fullmatch(cells[1])[1]) for owner in owners)
        elif current is not None and _CELL.fullmatch(cells[0]):
            pairs.add((current, _CELL.fullmatch(cells[0])[1]))
    return pairs


DOCUMENTED = _documented_fields()


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_every_field_of_every_message_is_documented(name):
    fields = {field.name for field in MESSAGES[name].fields}
    missing = sorted(f for f in fields if (name, f) not in DOCUMENTED)
    assert not missing, f"{name}: {missing}"


@pytest.mark.parametrize(
    ("service", "method"),
    [(s.name, m.name) for f in FILES for s in f.services_by_name.values() for m in s.methods],
)
def test_every_rpc_is_documented(service, method):
    assert f"| `{method}` |" in API, f"{service}.{method}"


@pytest.mark.parametrize(
    "value", [v.name for f in FILES for e in f.enum_types_by_name.values() for v in e.values]
)
def test_every_enum_value_is_documented(value):
    assert f"`{value}`" in API
