"""The engine's Prometheus metrics, named after vLLM's set (expert_engine_ in place of vllm:)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from libs.engine.outputs import EngineStats, RequestMetrics

_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineMetrics:
    """Per-request histograms observed when a request finishes; gauges and totals from stats snapshots."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "expert_engine_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY
        )
        self.itl = Histogram(
            "expert_engine_inter_token_latency_seconds", "Time between output tokens", buckets=_LATENCY
        )
        self.queue = Histogram(
            "expert_engine_request_queue_time_seconds",
            "Time requests waited to be scheduled",
            buckets=_LATENCY,
        )
        self.e2e = Histogram(
            "expert_engine_e2e_request_latency_seconds", "Request latency in the engine", buckets=_LATENCY
        )
        self.success = Counter(
            "expert_engine_request_success_total", "Finished requests", ["finished_reason"]
        )
        self.running = Gauge("expert_engine_num_requests_running", "Sequences running")
        self.waiting = Gauge("expert_engine_num_requests_waiting", "Sequences waiting")
        self.kv_usage = Gauge("expert_engine_kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.kv_blocks = Gauge(
            "expert_engine_kv_blocks", "KV blocks by state (used + cached + free = all of them)", ["state"]
        )
        self.prefix_queries = Counter("expert_engine_prefix_cache_queries_total", "Prompt tokens looked up")
        self.prefix_hits = Counter(
            "expert_engine_prefix_cache_hits_total", "Prompt tokens found in the cache"
        )
        self.prompt_tokens = Counter("expert_engine_prompt_tokens_total", "Prompt tokens computed")
        self.generation_tokens = Counter("expert_engine_generation_tokens_total", "Tokens generated")
        self.preemptions = Counter("expert_engine_num_preemptions_total", "Sequences preempted")
        self.experts_resident = Gauge("expert_engine_experts_resident", "Experts in the device tier")
        self.expert_bytes = Gauge("expert_engine_expert_bytes", "Expert weights held", ["tier"])
        self.sessions = Gauge("expert_engine_sessions", "Sessions whose KV the engine keeps between turns")
        self.session_blocks = Gauge("expert_engine_session_kv_blocks", "KV blocks idle sessions keep")
        self.session_evictions = Counter(
            "expert_engine_session_evictions_total", "Idle sessions whose KV was given up under pressure"
        )
        self.session_recomputes = Counter(
            "expert_engine_session_recomputes_total",
            "Session turns that recomputed their history (evicted, diverged, new_here)",
            ["reason"],
        )
        self.draft_tokens = Counter(
            "expert_engine_spec_decode_draft_tokens_total", "Tokens drafted and verified", ["drafter"]
        )
        self.accepted_tokens = Counter(
            "expert_engine_spec_decode_accepted_tokens_total", "Drafted tokens the outputs kept", ["drafter"]
        )
        self.acceptance = Gauge(
            "expert_engine_spec_decode_acceptance_rate", "Accepted / drafted tokens since start", ["drafter"]
        )
        self._last: EngineStats | None = None

    def observe_request(self, m: RequestMetrics, finished_reason: str) -> None:
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.success.labels(finished_reason).inc()

    def update(self, stats: EngineStats) -> None:
        """Set gauges and advance counters by what changed since the previous snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        for state, blocks in (
            ("used", stats.kv_used_blocks),
            ("cached", stats.kv_cached_blocks),
            ("free", stats.kv_free_blocks),
        ):
            self.kv_blocks.labels(state).set(blocks)
        self.session_blocks.set(stats.kv_session_blocks)
        last = self._last
        for counter, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
            (self.prompt_tokens, stats.prompt_tokens_total, last.prompt_tokens_total if last else 0),
            (
                self.generation_tokens,
                stats.generation_tokens_total,
                last.generation_tokens_total if last else 0,
            ),
            (self.preemptions, stats.num_preemptions_total, last.num_preemptions_total if last else 0),
        ):
            if now > before:
                counter.inc(now - before)
        if stats.experts is not None:
            self.experts_resident.set(stats.experts.experts_resident)
            self.expert_bytes.labels("host").set(stats.experts.host_bytes)
            self.expert_bytes.labels("device").set(stats.experts.device_bytes)
        if stats.sessions is not None:
            self._update_sessions(stats.sessions, last.sessions if last else None)
        if stats.speculative is not None:
            self._update_speculative(stats.speculative, last.speculative if last else None)
        if stats.speculative_fallback is not None:
            fallback = stats.speculative_fallback
            self._update_speculative(fallback, last.speculative_fallback if last else None)
        self._last = stats

    def _update_speculative(self, now, before) -> None:
        drafter = now.drafter
        for counter, total, previous in (
            (self.draft_tokens, now.drafted_tokens_total, before.drafted_tokens_total if before else 0),
            (self.accepted_tokens, now.accepted_tokens_total, before.accepted_tokens_total if before else 0),
        ):
            if total > previous:
                counter.labels(drafter).inc(total - previous)
        self.acceptance.labels(drafter).set(now.acceptance_rate)

    def _update_sessions(self, now, before) -> None:
        self.sessions.set(now.sessions)
        evicted = now.evictions_total - (before.evictions_total if before else 0)
        if evicted > 0:
            self.session_evictions.inc(evicted)
        for reason, count in now.recomputes_total.items():
            new = count - (before.recomputes_total.get(reason, 0) if before else 0)
            if new > 0:
                self.session_recomputes.labels(reason).inc(new)
