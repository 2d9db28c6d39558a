"""Opens a GGUF file and reads its metadata, with errors that name the file or the key."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader


class GGUFImportError(Exception):
    """The GGUF file cannot be converted; the message names the problem."""


def open_gguf(path: Path) -> GGUFReader:
    """A reader for the GGUF at `path`; a missing, foreign or unreadable file is a `GGUFImportError`."""
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, struct.error) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF file: {exc}") from exc


class Metadata:
    """The GGUF's key/value metadata and tensors, with errors that name the missing key."""

    _REQUIRED = object()

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise GGUFImportError(f"missing metadata key {key!r}")
            return default
        return field.contents()

    def get_int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFImportError(f"metadata key {key!r} should be one integer, found {value!r}")
        return value

    def get_float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFImportError(f"metadata key {key!r} should be a number, found {value!r}")
        # GGUF stores float32: print its shortest round-trip form (1e-05, not 9.999999747378752e-06).
        return float(str(np.float32(value)))
