"""`AsyncExpertClient`: the asyncio client of the reception's InferenceService (grpc.aio)."""

from __future__ import annotations

from typing import Unpack

import grpc

from ._proto.expert.v1 import inference_pb2, inference_pb2_grpc
from .connection import CHANNEL_OPTIONS, DEFAULT_TIMEOUT, auth_metadata, default_target
from .errors import error_from_aio_call
from .request import RequestFields, build_request
from .results import (
    InferenceResult,
    Job,
    JobSubmission,
    job_from_proto,
    result_from_proto,
    submission_from_proto,
)
from .session import AsyncSession, SessionFields
from .stream import AsyncInferStream
from .training import AsyncTraining


class AsyncExpertClient:
    """`ExpertClient` for asyncio: the same calls, awaited, and `infer_stream` for `async for`.

    Create it inside the running event loop (grpc.aio channels belong to one loop), preferably as
    `async with AsyncExpertClient(target) as client:`. `api_key` (default: EXPERT_API_KEY) is sent
    with every call.
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
            self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(self.target, credentials, options=CHANNEL_OPTIONS)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        # Training jobs and their files (expert_system.training).
        self.training = AsyncTraining(self._channel, self._metadata)

    async def infer(
        self, prompt: str = "", *, timeout: float | None = None, **fields: Unpack[RequestFields]
    ) -> InferenceResult:
        """Run a job and wait for its result."""
        request = inference_pb2.InferRequest(request=build_request("infer", prompt, fields))
        return result_from_proto(
            (await _call(self._stub.Infer(request, timeout=timeout, metadata=self._metadata))).result
        )

    def infer_stream(
        self, prompt: str = "", *, timeout: float | None = None, **fields: Unpack[RequestFields]
    ) -> AsyncInferStream:
        """Run a job and stream its text: `async for chunk in stream`, then `stream.result`. A
        chunk with `restarted=True` means the job started over and the text so far is void."""
        request = inference_pb2.InferStreamRequest(request=build_request("infer_stream", prompt, fields))
        return AsyncInferStream(
            lambda: self._stub.InferStream(request, timeout=timeout, metadata=self._metadata)
        )

    async def submit(
        self, prompt: str = "", *, timeout: float | None = DEFAULT_TIMEOUT, **fields: Unpack[RequestFields]
    ) -> JobSubmission:
        """Queue a job and return at once; follow it with `get_job`."""
        request = inference_pb2.SubmitRequest(request=build_request("submit", prompt, fields))
        return submission_from_proto(
            (await _call(self._stub.Submit(request, timeout=timeout, metadata=self._metadata))).submission
        )

    async def get_job(self, job_id: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> Job:
        """A job's status, its text so far, and its result once final."""
        call = self._stub.GetJob(
            inference_pb2.GetJobRequest(job_id=job_id), timeout=timeout, metadata=self._metadata
        )
        return job_from_proto((await _call(call)).job)

    async def cancel(self, job_id: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> Job:
        """Stop a job; returns its record after the cancellation."""
        call = self._stub.CancelJob(
            inference_pb2.CancelJobRequest(job_id=job_id), timeout=timeout, metadata=self._metadata
        )
        return job_from_proto((await _call(call)).job)

    def session(
        self, *, timeout: float | None = DEFAULT_TIMEOUT, **settings: Unpack[SessionFields]
    ) -> AsyncSession:
        """A multi-turn session, created by `async with client.session(...) as session:` (which
        ends it on exit) or by `session = await client.session(...)`."""
        return AsyncSession(self._channel, self._metadata, settings, timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncExpertClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


async def _call(call: grpc.aio.UnaryUnaryCall):
    try:
        return await call
    except grpc.aio.AioRpcError:
        raise await error_from_aio_call(call) from None
