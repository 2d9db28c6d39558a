"""Protobuf timestamps from the seconds since the epoch that `time.time()` gives."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
