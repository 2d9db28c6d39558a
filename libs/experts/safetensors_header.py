"""Read the header of a safetensors file held in memory, without loading any tensor.

The format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
`{"dtype", "shape", "data_offsets": [begin, end]}` (plus an optional `__metadata__` of strings),
then the tensors' bytes. We check what `safetensors` itself would refuse later (sizes that disagree
with the shapes, offsets outside the buffer, gaps or overlaps) so that a verified package always
loads.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

# Bytes per element of each safetensors dtype.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# A header is a few KiB for an adapter; safetensors itself caps it at 100 MB.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it: name, shape and stored dtype (`F32`, `BF16`, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(data: bytes) -> tuple[TensorInfo, ...]:
    """The tensors of the safetensors bytes `data`, sorted by name; a ValueError says what is wrong."""
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"header length {header_len} runs past the end of the file")
    try:
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not an object of strings")
    buffer_len = len(data) - 8 - header_len
    tensors, spans = [], []
    for name, entry in header.items():
        info, begin, end = _parse_entry(name, entry, buffer_len)
        tensors.append(info)
        spans.append((begin, end, name))
    # safetensors requires the data buffer to be exactly tiled by the tensors.
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"tensor {name!r}: data starts at {begin}, expected {position} (gap or overlap)")
        position = end
    if position != buffer_len:
        raise ValueError(f"{buffer_len - position} bytes after the last tensor")
    return tuple(sorted(tensors, key=lambda t: t.name))


def _parse_entry(name: str, entry: object, buffer_len: int) -> tuple[TensorInfo, int, int]:
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not begin <= end <= buffer_len:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets} outside the {buffer_len}-byte buffer")
    info = TensorInfo(name, tuple(shape), dtype)
    if end - begin != info.numel * DTYPE_SIZES[dtype]:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype}")
    return info, begin, end


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
