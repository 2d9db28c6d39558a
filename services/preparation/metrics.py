"""Preparation's Prometheus metrics: the fleet, placements and refusals."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.preparation.fleet import Fleet


class PreparationMetrics:
    def __init__(self) -> None:
        self.engines = Gauge("expert_preparation_engines", "Registered engines")
        self.active_jobs = Gauge("expert_preparation_active_jobs", "Jobs placed and not yet released")
        self.free_slots = Gauge("expert_preparation_free_slots", "Jobs the fleet can start now")
        self.kv_blocks_free = Gauge("expert_preparation_kv_blocks_free", "Free KV blocks across engines")
        self.placed = Counter("expert_preparation_placements_total", "Jobs placed", ["engine"])
        self.refused = Counter("expert_preparation_refusals_total", "Prepare calls refused", ["code"])
        self.expired = Counter(
            "expert_preparation_engines_expired_total", "Engines dropped for missed heartbeats"
        )
        self.prepare_latency = Histogram(
            "expert_preparation_prepare_latency_seconds",
            "Time to place a job (seed 000 budget: 1-200 ms)",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0),
        )

    def update(self, fleet: Fleet) -> None:
        capacity = fleet.capacity()
        self.engines.set(len(fleet.engines))
        self.active_jobs.set(len(fleet.jobs))
        self.free_slots.set(capacity.max_num_seqs)
        self.kv_blocks_free.set(capacity.kv_blocks_free)
