"""RouterService: plans requests and keeps the expert registry."""

from __future__ import annotations

import grpc

from libs.errors import failed_precondition
from libs.gen.expert.v1 import router_pb2, router_pb2_grpc
from libs.logging import bind_context
from services.router.metrics import RouterMetrics
from services.router.planner import Planner
from services.router.registry import Registry


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, planner: Planner, metrics: RouterMetrics, registry: Registry | None = None) -> None:
        self.planner = planner
        self.metrics = metrics
        self.registry = registry  # None: a router without an expert index (registry calls are refused)

    def _registry(self) -> Registry:
        if self.registry is None:
            raise failed_precondition("this router runs without an expert index")
        return self.registry

    async def RegisterExpert(
        self, request: router_pb2.RegisterExpertRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterExpertResponse:
        return self._registry().register(request)

    async def GetRegisteredExpert(
        self, request: router_pb2.GetRegisteredExpertRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetRegisteredExpertResponse:
        return router_pb2.GetRegisteredExpertResponse(expert=self._registry().get(request.name))

    async def ListRegisteredExperts(
        self, request: router_pb2.ListRegisteredExpertsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListRegisteredExpertsResponse:
        return router_pb2.ListRegisteredExpertsResponse(experts=self._registry().list())

    async def UnregisterExpert(
        self, request: router_pb2.UnregisterExpertRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.UnregisterExpertResponse:
        return router_pb2.UnregisterExpertResponse(expert=self._registry().unregister(request.name))

    async def Plan(
        self, request: router_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PlanResponse:
        with bind_context(job_id=request.job_id):
            plan, selection = await self.planner.plan(
                request.request,
                request.max_model_len or None,
                request.model_defaults,
                request.base_model_hash,
            )
            self.metrics.observe(plan, selection)
            return router_pb2.PlanResponse(plan=plan)
