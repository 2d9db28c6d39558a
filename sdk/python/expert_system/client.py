"""`ExpertClient`: the blocking client of the reception's InferenceService."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, Unpack

import grpc

from ._proto.expert.v1 import inference_pb2, inference_pb2_grpc
from .connection import (  # re-exported: `expert_system.client.CHANNEL_OPTIONS` and the rest stay
    API_KEY_ENV,
    CHANNEL_OPTIONS,
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT,
    TARGET_ENV,
    auth_metadata,
    default_target,
)
from .errors import error_from_call
from .request import RequestFields, build_request
from .results import (
    InferenceResult,
    Job,
    JobSubmission,
    job_from_proto,
    result_from_proto,
    submission_from_proto,
)
from .session import Session, SessionFields
from .stream import InferStream
from .training import Training

__all__ = [
    "API_KEY_ENV",
    "CHANNEL_OPTIONS",
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT",
    "TARGET_ENV",
    "ExpertClient",
    "auth_metadata",
    "default_target",
]

_Response = TypeVar("_Response")


class ExpertClient:
    """A connection to the reception at `target` (host:port; default `default_target()`).

    The request keywords of `infer`, `infer_stream` and `submit` are the fields of
    `InferenceRequest` (see `RequestFields`); one left out stays unset and the router decides it.
    `timeout` is the call's deadline in seconds. A failed call raises an `ExpertSystemError`.
    `api_key` (default: EXPERT_API_KEY) is sent with every call when the stack requires keys.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
    ):
        self.target = target or default_target()
        self._metadata = auth_metadata(api_key)
        if credentials is None:
            self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(self.target, credentials, options=CHANNEL_OPTIONS)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        # Training jobs and their files (expert_system.training).
        self.training = Training(self._channel, self._metadata)

    def infer(
        self, prompt: str = "", *, timeout: float | None = None, **fields: Unpack[RequestFields]
    ) -> InferenceResult:
        """Run a job and wait for its result."""
        request = inference_pb2.InferRequest(request=build_request("infer", prompt, fields))
        return result_from_proto(self._call(self._stub.Infer, request, timeout).result)

    def infer_stream(
        self, prompt: str = "", *, timeout: float | None = None, **fields: Unpack[RequestFields]
    ) -> InferStream:
        """Run a job and stream its text: iterate the returned `InferStream` for `StreamChunk`s,
        then read its `result`. A chunk with `restarted=True` means the job started over and the
        text received so far must be discarded. The call starts when the iteration does."""
        request = inference_pb2.InferStreamRequest(request=build_request("infer_stream", prompt, fields))
        return InferStream(lambda: self._stub.InferStream(request, timeout=timeout, metadata=self._metadata))

    def submit(
        self, prompt: str = "", *, timeout: float | None = DEFAULT_TIMEOUT, **fields: Unpack[RequestFields]
    ) -> JobSubmission:
        """Queue a job and return at once; follow it with `get_job`."""
        request = inference_pb2.SubmitRequest(request=build_request("submit", prompt, fields))
        return submission_from_proto(self._call(self._stub.Submit, request, timeout).submission)

    def get_job(self, job_id: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> Job:
        """A job's status, its text so far, and its result once final."""
        request = inference_pb2.GetJobRequest(job_id=job_id)
        return job_from_proto(self._call(self._stub.GetJob, request, timeout).job)

    def cancel(self, job_id: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> Job:
        """Stop a job; returns its record after the cancellation."""
        request = inference_pb2.CancelJobRequest(job_id=job_id)
        return job_from_proto(self._call(self._stub.CancelJob, request, timeout).job)

    def session(
        self, *, timeout: float | None = DEFAULT_TIMEOUT, **settings: Unpack[SessionFields]
    ) -> Session:
        """Open a multi-turn session (its settings are the keywords of `SessionFields`), created
        at once; use it as a context manager, which ends it on exit. See `expert_system.session`."""
        return Session(self._channel, self._metadata, settings, timeout)

    def _call(self, method: Callable[..., _Response], request, timeout: float | None) -> _Response:
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_call(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ExpertClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
