"""The job metrics (docs/design.md#post-processing), exported as Prometheus metrics by postproc."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from libs.gen.expert.v1 import common_pb2

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PostprocMetrics:
    def __init__(self) -> None:
        self.jobs = Counter("expert_postproc_jobs_total", "Jobs finalized", ["status", "validation"])
        self.validation_failures = Counter(
            "expert_postproc_validation_failures_total", "Outputs that failed validation", ["validator"]
        )
        self.tokens_in = Counter("expert_postproc_input_tokens_total", "Prompt tokens of finalized jobs")
        self.tokens_out = Counter("expert_postproc_output_tokens_total", "Generated tokens of finalized jobs")
        self.experts = Counter("expert_postproc_expert_uses_total", "Experts applied to finalized jobs")
        self.total = Histogram(
            "expert_postproc_job_latency_seconds", "End-to-end job latency", buckets=_LATENCY_BUCKETS
        )
        self.router = Histogram(
            "expert_postproc_router_latency_seconds",
            "Router (plan) latency of jobs",
            buckets=_LATENCY_BUCKETS,
        )
        self.inference = Histogram(
            "expert_postproc_inference_latency_seconds", "Engine latency of jobs", buckets=_LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "expert_postproc_queue_latency_seconds", "Time jobs waited in the queue", buckets=_LATENCY_BUCKETS
        )
        self.ttft = Histogram(
            "expert_postproc_time_to_first_token_seconds",
            "Engine time to first token",
            buckets=_LATENCY_BUCKETS,
        )
        self.tokens_per_second = Histogram(
            "expert_postproc_decode_tokens_per_second",
            "Decode speed of jobs",
            buckets=(1, 5, 10, 20, 30, 50, 75, 100, 150, 250, 500),
        )
        self.finalize = Histogram(
            "expert_postproc_finalize_latency_seconds",
            "Postproc's own time per job",
            buckets=_LATENCY_BUCKETS,
        )

    def observe(self, m: common_pb2.InferenceMetrics, status: int, validator: str) -> None:
        self.jobs.labels(
            common_pb2.JobStatus.Name(status).removeprefix("JOB_STATUS_").lower(),
            "passed" if m.validation_passed else "failed",
        ).inc()
        if not m.validation_passed:
            self.validation_failures.labels(validator).inc()
        self.tokens_in.inc(m.input_tokens)
        self.tokens_out.inc(m.output_tokens)
        self.experts.inc(m.num_experts)
        self.total.observe(m.total_latency_ms / 1000)
        self.router.observe(m.router_latency_ms / 1000)
        self.inference.observe(m.inference_latency_ms / 1000)
        self.queue.observe(m.queue_latency_ms / 1000)
        if m.ttft_ms:
            self.ttft.observe(m.ttft_ms / 1000)
        if m.tokens_per_second:
            self.tokens_per_second.observe(m.tokens_per_second)
        self.finalize.observe(m.postproc_latency_ms / 1000)
