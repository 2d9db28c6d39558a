"""PostprocService: finalizes jobs."""

from __future__ import annotations

import grpc

from libs.gen.expert.v1 import postproc_pb2, postproc_pb2_grpc
from libs.logging import bind_context
from services.postproc.finalizer import Finalizer


class PostprocServicer(postproc_pb2_grpc.PostprocServiceServicer):
    def __init__(self, finalizer: Finalizer) -> None:
        self.finalizer = finalizer

    async def Finalize(
        self, request: postproc_pb2.FinalizeRequest, context: grpc.aio.ServicerContext
    ) -> postproc_pb2.FinalizeResponse:
        with bind_context(job_id=request.job_id):
            return postproc_pb2.FinalizeResponse(result=await self.finalizer.finalize(request))
