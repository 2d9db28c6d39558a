"""The router's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from libs.gen.expert.v1 import common_pb2
from services.router.selection import Selection


class RouterMetrics:
    def __init__(self) -> None:
        self.plan_latency = Histogram(
            "expert_router_plan_latency_seconds",
            "Time to plan a request (stage budget: 10-50 ms, docs/design.md#stage-budgets)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
        )
        self.plans = Counter("expert_router_plans_total", "Requests planned", ["task_type"])
        self.fallbacks = Counter("expert_router_fallbacks_total", "Plans that fell back to the base model")
        self.selected = Histogram(
            "expert_router_selected_experts", "Experts per plan", buckets=(0, 1, 2, 3, 5, 10)
        )
        self.candidates = Histogram(
            "expert_router_candidate_experts",
            "Candidates scored per plan (heuristic, retrieved and forced)",
            buckets=(0, 1, 2, 5, 10, 20, 30, 50),
        )

    def observe(self, plan: common_pb2.ExpertPlan, selection: Selection | None = None) -> None:
        self.plan_latency.observe(plan.router_latency_ms / 1000)
        self.plans.labels(plan.features.task_type).inc()
        if plan.fallback:
            self.fallbacks.inc()
        self.selected.observe(len(plan.experts))
        self.candidates.observe(len(selection.considered) if selection else 0)
