"""libs.metrics: RPC metrics created once per service, and an idempotent /metrics endpoint."""

from __future__ import annotations

import urllib.request

import pytest

from libs.metrics import rpc_metrics, start_metrics_server
from tests.helpers.ports import free_port


def test_rpc_metrics_are_created_once_per_service():
    first = rpc_metrics("metricstest")
    assert rpc_metrics("metricstest") is first
    assert rpc_metrics("othermetricstest") is not first


def test_a_service_name_must_fit_a_metric_name():
    with pytest.raises(ValueError):
        rpc_metrics("Bad-Name")


def test_the_endpoint_serves_the_rpc_metrics_and_starts_once_per_port():
    rpc_metrics("endpointtest").observe("expert.v1.RouterService/Plan", "OK", 0.003)
    port = free_port()
    start_metrics_server(port, "127.0.0.1")
    start_metrics_server(port, "127.0.0.1")
    start_metrics_server(0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert (
        'expert_endpointtest_rpc_requests_total{code="OK",method="expert.v1.RouterService/Plan"} 1.0' in text
    )
    assert (
        'expert_endpointtest_rpc_latency_seconds_bucket{le="0.005",method="expert.v1.RouterService/Plan"} 1.0'
        in text
    )
