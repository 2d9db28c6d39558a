"""Reception's Prometheus metrics: submissions, validation, the queue and job outcomes."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from libs.gen.expert.v1 import common_pb2

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_JOB = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# The `field` of a refusal no field is to blame for (the requests_rejected_total labels, both fronts).
REFUSED_BODY = "body"  # HTTP: too large, not JSON, nested too deep, no JSON Content-Type
REFUSED_CREDENTIALS = "authorization"  # a missing, wrong or revoked key; a key without the scope
REFUSED_RATE = "rate_limit"  # a key over its limits
REFUSED_UNKNOWN_FIELD = "unknown_field"  # HTTP: a field the API does not know (its name is the client's)


class ReceptionMetrics:
    """Reception's metrics, in `registry` (the default one, which /metrics serves; tests give their own)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def counter(name: str, doc: str, labels: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels or [], registry=registry)

        self.submitted = counter("expert_reception_jobs_submitted_total", "Jobs accepted", ["priority"])
        self.rejected = counter(
            "expert_reception_requests_rejected_total",
            "Requests refused (both fronts), by the field to blame or what was refused",
            ["field"],
        )
        self.ignored_fields = counter(
            "expert_reception_ignored_fields_total",
            "OpenAI request fields accepted and ignored (the HTTP front's list), by field",
            ["field"],
        )
        self.admission = Histogram(
            "expert_reception_admission_latency_seconds",
            "A call's admission: validation, normalization, the job record and the enqueue",
            buckets=_FAST,
            registry=registry,
        )
        self.finished_jobs = counter(
            "expert_reception_jobs_finished_total", "Jobs that reached a final state", ["status"]
        )
        self.job_latency = Histogram(
            "expert_reception_job_latency_seconds",
            "Submission to final state",
            buckets=_JOB,
            registry=registry,
        )
        self.unvalidated = counter(
            "expert_reception_results_unvalidated_total",
            "Jobs whose result was recorded without postproc (unreachable until the job's deadline): "
            "no validation, marked validation_skipped",
        )
        self.redis_compactions = counter(
            "expert_reception_redis_compactions_total",
            "Rewrites of Redis's append-only file asked for after ended jobs' texts left Redis "
            "(EXPERT_STORE_REQUEST_TEXT=false), by outcome: rewritten, no_aof, refused",
            ["outcome"],
        )
        self.queue_depth = Gauge(
            "expert_reception_queue_depth",
            "Jobs waiting for a dispatcher, by priority",
            ["priority"],
            registry=registry,
        )

    def refused(self, field: str) -> None:
        """Counts a refused request by the field to blame as gRPC names it (`request.temperature`;
        an index and what follows it dropped: `request.messages`), or by what was refused (REFUSED_*)."""
        self.rejected.labels(field.split("[")[0]).inc()

    def finished(self, result: common_pb2.InferenceResult) -> None:
        status = common_pb2.JobStatus.Name(result.status).removeprefix("JOB_STATUS_").lower()
        self.finished_jobs.labels(status).inc()
        self.job_latency.observe(result.latency_ms / 1000)
        if result.validation_skipped:
            self.unvalidated.inc()
