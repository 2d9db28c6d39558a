"""Prometheus metrics shared by the services: the /metrics HTTP endpoint and the per-service RPC
metrics that the server interceptor records.

Everything is registered in prometheus_client's default registry, so the metrics a service defines
itself (with names `expert_<service>_...`) are served by the same endpoint.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import prometheus_client

# From a 1 ms health check to a 60 s generation; Prometheus adds +Inf.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_SERVICE = re.compile(r"^[a-z][a-z0-9_]*$")
_lock = threading.Lock()
_servers: dict[int, object] = {}
_rpc_metrics: dict[str, RpcMetrics] = {}


@dataclass(frozen=True)
class RpcMetrics:
    """The RPC metrics of one service: `requests` counts finished RPCs by `method` and status `code`
    (e.g. OK, INVALID_ARGUMENT); `latency` observes their duration in seconds by `method`."""

    requests: prometheus_client.Counter
    latency: prometheus_client.Histogram

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Records one finished RPC."""
        self.requests.labels(method=method, code=code).inc()
        self.latency.labels(method=method).observe(seconds)


def rpc_metrics(service: str) -> RpcMetrics:
    """`expert_<service>_rpc_requests_total{method,code}` and
    `expert_<service>_rpc_latency_seconds{method}`, created on the first call for `service` and
    returned again by later calls (registering a metric name twice is an error in Prometheus)."""
    if not _SERVICE.match(service):
        raise ValueError(f"service name must match {_SERVICE.pattern}, got {service!r}")
    with _lock:
        metrics = _rpc_metrics.get(service)
        if metrics is None:
            metrics = RpcMetrics(
                requests=prometheus_client.Counter(
                    f"expert_{service}_rpc_requests",
                    "gRPC requests handled, by method and status code.",
                    ["method", "code"],
                ),
                latency=prometheus_client.Histogram(
                    f"expert_{service}_rpc_latency_seconds",
                    "Time from receiving a gRPC request to sending its status.",
                    ["method"],
                    buckets=LATENCY_BUCKETS,
                ),
            )
            _rpc_metrics[service] = metrics
        return metrics


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> None:
    """Serves the default registry at http://addr:port/metrics from a daemon thread. Port 0 disables
    the endpoint; a second call for a port already served does nothing (several services may share
    a process in tests). Raises OSError when the port is taken by someone else."""
    if port == 0:
        return
    if not 0 < port <= 65535:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    with _lock:
        if port in _servers:
            return
        # An IPv6 bind host arrives bracketed from gRPC-style addresses; the HTTP server wants it bare.
        server, _thread = prometheus_client.start_http_server(port, addr=addr.strip("[]"))
        _servers[port] = server
