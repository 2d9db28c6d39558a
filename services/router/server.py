"""RouterService: plans requests."""

from __future__ import annotations

import grpc

from libs.gen.expert.v1 import router_pb2, router_pb2_grpc
from libs.logging import bind_context
from services.router.metrics import RouterMetrics
from services.router.planner import Planner


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, planner: Planner, metrics: RouterMetrics) -> None:
        self.planner = planner
        self.metrics = metrics

    async def Plan(
        self, request: router_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PlanResponse:
        with bind_context(job_id=request.job_id):
            plan = self.planner.plan(request.request, request.max_model_len or None)
            self.metrics.observe(plan)
            return router_pb2.PlanResponse(plan=plan)
