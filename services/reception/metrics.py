"""Reception's Prometheus metrics: submissions, validation, the queue and job outcomes."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from libs.gen.expert.v1 import common_pb2

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_JOB = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ReceptionMetrics:
    def __init__(self) -> None:
        self.submitted = Counter("expert_reception_jobs_submitted_total", "Jobs accepted", ["priority"])
        self.rejected = Counter(
            "expert_reception_requests_rejected_total", "Requests refused as invalid", ["field"]
        )
        self.admission = Histogram(
            "expert_reception_admission_latency_seconds",
            "A call's admission: validation, normalization, the job record and the enqueue",
            buckets=_FAST,
        )
        self.finished_jobs = Counter(
            "expert_reception_jobs_finished_total", "Jobs that reached a final state", ["status"]
        )
        self.job_latency = Histogram(
            "expert_reception_job_latency_seconds", "Submission to final state", buckets=_JOB
        )
        self.unvalidated = Counter(
            "expert_reception_results_unvalidated_total",
            "Jobs whose result was recorded without postproc (unreachable until the job's deadline): "
            "no validation, marked validation_skipped",
        )
        self.redis_compactions = Counter(
            "expert_reception_redis_compactions_total",
            "Rewrites of Redis's append-only file asked for after ended jobs' texts left Redis "
            "(EXPERT_STORE_REQUEST_TEXT=false), by outcome: rewritten, no_aof, refused",
            ["outcome"],
        )
        self.queue_depth = Gauge(
            "expert_reception_queue_depth", "Jobs waiting for a dispatcher, by priority", ["priority"]
        )

    def finished(self, result: common_pb2.InferenceResult) -> None:
        status = common_pb2.JobStatus.Name(result.status).removeprefix("JOB_STATUS_").lower()
        self.finished_jobs.labels(status).inc()
        self.job_latency.observe(result.latency_ms / 1000)
        if result.validation_skipped:
            self.unvalidated.inc()
