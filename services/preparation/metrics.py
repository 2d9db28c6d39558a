"""Preparation's Prometheus metrics: the fleet, placements, refusals, staging and the experts each
engine holds."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from services.preparation.fleet import Fleet


class PreparationMetrics:
    def __init__(self, max_hot_experts: int = 0) -> None:
        self.max_hot_experts = max_hot_experts
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
            "Time to place a job (stage budget: 1-200 ms, docs/design.md#stage-budgets)",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0),
        )

        self.staged_bytes = Counter(
            "expert_preparation_staged_bytes_total", "Expert package bytes sent to engines"
        )
        self.staging_latency = Histogram(
            "expert_preparation_staging_seconds",
            "Time to stage one expert package on an engine (LoadExpert)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.expert_cache = Counter(
            "expert_preparation_expert_cache_total",
            "Planned experts the chosen engine held already (hit) or had to be sent (miss)",
            ["result"],
        )
        self.evictions = Counter(
            "expert_preparation_expert_evictions_total",
            "Experts unloaded from an engine to make room (least recently used, unreferenced)",
        )
        self.degraded = Counter(
            "expert_preparation_degraded_plans_total", "Plans placed with fewer experts than planned"
        )
        self.dropped = Counter(
            "expert_preparation_dropped_experts_total",
            "Planned experts dropped: over the device budget, or not stageable",
            ["reason"],
        )
        # vLLM's vllm:lora_requests_info, per engine: the facts are labels, the value is when they
        # were last seen (a gateway reads placement from it).
        self.engine_experts = Gauge(
            "expert_preparation_engine_experts_info",
            "Experts each engine holds and the ones placed jobs use there (value: unix time seen)",
            ["engine", "held_experts", "active_experts", "max_hot_experts"],
        )
        self._engine_labels: dict[str, tuple[str, ...]] = {}

    def update(self, fleet: Fleet) -> None:
        capacity = fleet.capacity()
        self.engines.set(len(fleet.engines))
        self.active_jobs.set(len(fleet.jobs))
        self.free_slots.set(capacity.free_slots)
        self.kv_blocks_free.set(capacity.kv_blocks_free)
        now = time.time()
        for engine_id, engine in fleet.engines.items():
            labels = (
                engine_id,
                ",".join(sorted(engine.held())),
                ",".join(sorted(engine.references())),
                str(self.max_hot_experts),
            )
            previous = self._engine_labels.get(engine_id)
            if previous is not None and previous != labels:
                self.engine_experts.remove(*previous)
            self._engine_labels[engine_id] = labels
            self.engine_experts.labels(*labels).set(now)
        for engine_id in set(self._engine_labels) - set(fleet.engines):
            self.engine_experts.remove(*self._engine_labels.pop(engine_id))
