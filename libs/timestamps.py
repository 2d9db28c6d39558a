"""Protobuf timestamps from the seconds since the epoch that `time.time()` gives."""

from __future__ import annotations

import math

from google.protobuf.timestamp_pb2 import Timestamp


def timestamp(seconds: float) -> Timestamp:
    # Seconds and the fraction apart: `seconds * 1e9` as one float loses the last digits (0.25 s
    # would become 249,999,872 ns).
    whole = math.floor(seconds)
    nanos = round((seconds - whole) * 1e9)
    if nanos == 1_000_000_000:
        whole, nanos = whole + 1, 0
    return Timestamp(seconds=whole, nanos=nanos)
