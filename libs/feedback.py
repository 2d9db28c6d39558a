"""The feedback stream postproc writes and the routers learn from (one Redis stream).

Each entry holds one `FeedbackRecord` (common.proto), serialized, in its field `record`.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.message import DecodeError

from libs.gen.expert.v1 import common_pb2

FEEDBACK_STREAM = "expert:feedback"
RECORD_FIELD = "record"


def entry_fields(record: common_pb2.FeedbackRecord) -> dict[str, bytes]:
    return {RECORD_FIELD: record.SerializeToString()}


def read_record(fields: Mapping[str | bytes, bytes]) -> common_pb2.FeedbackRecord | None:
    """The record of a stream entry, or None when the entry holds none that parses."""
    data = fields.get(RECORD_FIELD, fields.get(RECORD_FIELD.encode()))
    if data is None:
        return None
    try:
        return common_pb2.FeedbackRecord.FromString(data)
    except DecodeError:
        return None
