"""The trainer's Prometheus metrics (docs/operations.md#metrics)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.jobs = Counter(
            "expert_trainer_jobs_total",
            "Training job runs ended: COMPLETED, FAILED, CANCELLED or HANDED_BACK",
            ["status"],
            registry=registry,
        )
        self.steps = Counter("expert_trainer_steps_total", "Optimizer steps trained", registry=registry)
        self.checkpoints = Counter(
            "expert_trainer_checkpoints_total", "Checkpoints written", registry=registry
        )
