"""InferenceService: reception's public gRPC API, an adapter over the admission core.

Each method turns its request message into a call of `Admission` (admission/core.py: the job id,
limits, validation, the record and the enqueue; following and cancelling the job) and the answer
into its response message. The dispatcher runs the job; Infer and InferStream follow its events in
Redis, so any reception instance can answer for a job any dispatcher runs. A client that hangs up
cancels its job.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from libs.auth.policy import Access, methods
from libs.errors import invalid_argument
from libs.gen.expert.v1 import common_pb2, inference_pb2
from services.reception.admission.core import Admission, Submitted, Undecodable
from services.reception.job_events import Delta, Finished, JobEvent, Restarted, StatusChanged
from services.reception.tolerant import add_tolerant_service

SERVICE = "expert.v1.InferenceService"
# Every call of the public API needs an API key (any scope) when auth is on.
_METHODS = ("Infer", "InferStream", "Submit", "GetJob", "CancelJob")
ACCESS = methods(SERVICE, dict.fromkeys(_METHODS, Access.INFER))


class ReceptionServicer:
    """InferenceService's methods over `admission`."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def Submit(
        self, request: inference_pb2.SubmitRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SubmitResponse:
        return inference_pb2.SubmitResponse(submission=await self.admission.submit(_inner(request)))

    async def Infer(
        self, request: inference_pb2.InferRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.InferResponse:
        return inference_pb2.InferResponse(result=await self.admission.infer(_inner(request)))

    async def InferStream(
        self, request: inference_pb2.InferStreamRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.InferStreamResponse]:
        async with contextlib.aclosing(self.admission.stream(_inner(request))) as events:
            async for event in events:
                yield stream_response(event)

    async def GetJob(
        self, request: inference_pb2.GetJobRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetJobResponse:
        return inference_pb2.GetJobResponse(job=await self.admission.get_job(_job_id(request)))

    async def CancelJob(
        self, request: inference_pb2.CancelJobRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CancelJobResponse:
        return inference_pb2.CancelJobResponse(job=await self.admission.cancel_job(_job_id(request)))


def stream_response(event: Submitted | JobEvent) -> inference_pb2.InferStreamResponse:
    """InferStream's message for an event of a followed job (the REST stream sends the same
    messages, as JSON)."""
    match event:
        case Submitted(submission):
            return inference_pb2.InferStreamResponse(submitted=submission)
        case StatusChanged(status):
            return inference_pb2.InferStreamResponse(status=status)
        case Delta(delta):
            return inference_pb2.InferStreamResponse(delta=delta)
        case Restarted(attempt):
            return inference_pb2.InferStreamResponse(restarted_attempt=attempt)
        case Finished(result):
            return inference_pb2.InferStreamResponse(result=result)
    raise TypeError(f"not a job event: {event!r}")


def _inner(request: object) -> common_pb2.InferenceRequest | Undecodable:
    return request if isinstance(request, Undecodable) else request.request


def _job_id(request: object) -> str:
    if isinstance(request, Undecodable):
        raise invalid_argument(
            "job_id", f"not a valid request message ({request.reason}); it must be valid UTF-8"
        )
    return request.job_id


def add_to_server(servicer: ReceptionServicer, server: grpc.aio.Server) -> str:
    """Register the servicer (bad UTF-8 is INVALID_ARGUMENT: tolerant.py)."""
    return add_tolerant_service(
        server, SERVICE, servicer, _METHODS, inference_pb2, streaming=("InferStream",)
    )
