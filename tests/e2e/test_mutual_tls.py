"""A stack with EXPERT_AUTH=required whose services call each other over mutual TLS, with the
certificates LocalStack makes (tools.local_ca), on the tiny model: jobs run end to end; a caller
without a certificate from the stack's CA, the internal token in hand, reaches no internal service,
and a rogue engine cannot register; the certificates are the owner's only
(docs/operations.md#security)."""

from __future__ import annotations

import stat

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import (
    common_pb2,
    keys_pb2,
    keys_pb2_grpc,
    preparation_pb2,
    preparation_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.e2e.conftest import ready_tiny_stack
from tools.stack import SERVICES, TRAINER, LocalStack, health_status

TOKEN = "e2e-mtls-internal-token-0123456789abcdef"
INTERNAL = credentials_metadata(internal_token=TOKEN)


@pytest.fixture(scope="module")
def secured(tiny_llama, tmp_path_factory) -> LocalStack:
    root = tmp_path_factory.mktemp("mtls-stack")
    with ready_tiny_stack(tiny_llama, root, EXPERT_AUTH="required", EXPERT_INTERNAL_TOKEN=TOKEN) as stack:
        yield stack


def _api_key(stack: LocalStack) -> str:
    # Reception's gRPC port is public (API keys, no client certificate): the first key is made
    # there with the internal token, over 127.0.0.1.
    with grpc.insecure_channel(stack.target("reception")) as channel:
        response = keys_pb2_grpc.KeyServiceStub(channel).CreateKey(
            keys_pb2.CreateKeyRequest(name="mtls", scope=keys_pb2.KEY_SCOPE_INFER),
            metadata=INTERNAL,
            timeout=10,
        )
    return response.secret


def test_jobs_run_end_to_end_over_mutual_tls(secured):
    for service in SERVICES:  # reception's own port is public: API keys, no client certificate
        expected = '"tls": false' if service == "reception" else '"tls": true'
        assert expected in secured.log_path(service).read_text(), service
    headers = {"Authorization": f"Bearer {_api_key(secured)}"}
    with httpx.Client(base_url=secured.http_url(), headers=headers, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for prompt in ("Hello", "The sky is", "One, two,"):
            response = http.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0},
            )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # Each job went through every internal hop over mutual TLS (router: Plan, preparation: Prepare,
    # the engine: Generate, postproc: Finalize): there is no plaintext port left to go through.
    with secured.channel(secured.target("preparation")) as channel:
        engines = preparation_pb2_grpc.PreparationServiceStub(channel).ListEngines(
            preparation_pb2.ListEnginesRequest(), metadata=INTERNAL, timeout=10
        )
    assert len(engines.engines) == 1  # the stack's engine registered over mutual TLS


@pytest.mark.parametrize("service", ["router", "preparation", "engine", "postproc"])
def test_an_internal_port_refuses_a_caller_without_a_client_certificate_even_with_the_token(secured, service):
    with grpc.insecure_channel(secured.target(service)) as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), metadata=INTERNAL, timeout=10
        )
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call is made
    assert health_status(secured.target(service), credentials=secured.client_credentials()) == 1  # SERVING


def test_plan_with_the_stolen_token_but_no_certificate_is_refused(secured):
    with grpc.insecure_channel(secured.target("router")) as channel, pytest.raises(grpc.RpcError) as refused:
        router_pb2_grpc.RouterServiceStub(channel).Plan(
            router_pb2.PlanRequest(job_id="j"), metadata=INTERNAL, timeout=10
        )
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_rogue_engine_without_a_certificate_cannot_register(secured):
    rogue = common_pb2.EngineInfo(
        engine_id="rogue", address="127.0.0.1:9", instance_id="rogue-1", model=common_pb2.ModelSpec(name="x")
    )
    for channel in (
        grpc.insecure_channel(secured.target("preparation")),
        grpc.secure_channel(  # TLS that trusts the stack's CA, but without a certificate of its own
            secured.target("preparation"),
            grpc.ssl_channel_credentials(root_certificates=(secured.log_dir / "tls" / "ca.pem").read_bytes()),
        ),
    ):
        with channel, pytest.raises(grpc.RpcError) as refused:
            preparation_pb2_grpc.PreparationServiceStub(channel).RegisterEngine(
                preparation_pb2.RegisterEngineRequest(engine=rogue), metadata=INTERNAL, timeout=10
            )
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    with secured.channel(secured.target("preparation")) as channel:
        engines = preparation_pb2_grpc.PreparationServiceStub(channel).ListEngines(
            preparation_pb2.ListEnginesRequest(), metadata=INTERNAL, timeout=10
        )
    assert "rogue" not in [engine.engine_id for engine in engines.engines]


def test_the_certificates_are_readable_by_the_owner_only(secured):
    directory = secured.log_dir / "tls"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    names = sorted(path.name for path in directory.iterdir())
    assert names == sorted(
        ["ca.pem", *(f"{s}.{ext}" for s in (*SERVICES, TRAINER, "client") for ext in ("pem", "key"))]
    )
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
