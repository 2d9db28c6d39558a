"""A job's events as its followers read them: the entries of its events stream in Redis
(`expert:job:{id}:events`, written by jobs.py's scripts), decoded once, here, into small typed
values. Infer, InferStream, a session's GenerateStream and the HTTP streams all read these."""

from __future__ import annotations

from dataclasses import dataclass

from libs.gen.expert.v1 import common_pb2


@dataclass(frozen=True)
class StatusChanged:
    """The job moved to `status` (a common_pb2.JobStatus)."""

    status: int


@dataclass(frozen=True)
class Delta:
    """A choice's new text and logprobs."""

    delta: common_pb2.ChoiceDelta


@dataclass(frozen=True)
class Restarted:
    """The job started over (on another engine): readers discard the text so far."""

    attempt: int


@dataclass(frozen=True)
class Finished:
    """The job's final result: the last event of its stream."""

    result: common_pb2.InferenceResult


JobEvent = StatusChanged | Delta | Restarted | Finished


def decode_event(fields: dict[bytes, bytes]) -> JobEvent | None:
    """The event an entry of a job's events (or result) stream holds; None for a kind this version
    does not know (a newer reception's), which followers skip."""
    kind = fields.get(b"kind")
    if kind == b"status":
        return StatusChanged(int(fields[b"status"]))
    if kind == b"delta":
        return Delta(common_pb2.ChoiceDelta.FromString(fields[b"delta"]))
    if kind == b"restart":
        return Restarted(int(fields[b"attempt"]))
    if kind == b"result":
        return Finished(common_pb2.InferenceResult.FromString(fields[b"result"]))
    return None
