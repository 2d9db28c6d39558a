"""Mutual TLS between the services (libs.tls) on real gRPC servers with certificates from
tools.local_ca: a caller without a certificate from the CA fails the handshake, an engine channel
accepts only a certificate that names an engine, the internal token never leaves a plaintext
channel for a non-loopback target, the CA's files are owner-only, and a service with auth
required and no certificate refuses to start, naming the setting."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from libs import healthcheck
from libs.auth.config import AuthConfig
from libs.auth.policy import Authenticator
from libs.config import TlsConfig
from libs.gen.expert.v1 import router_pb2_grpc
from libs.grpc_client import Channels
from libs.tls import is_loopback_target, may_send_token
from tests.helpers.grpc_services import plan_request, running
from tools import local_ca
from tools.stack import SERVICES, TRAINER, LocalStack

TOKEN = "internal-token-for-tests-0123456789"


def _tls(identity: local_ca.Identity) -> TlsConfig:
    return TlsConfig.from_env(identity.env())


@pytest.fixture
def pki(tmp_path) -> dict[str, local_ca.Identity]:
    return local_ca.issue(tmp_path / "tls", ["router", "engine", "client"])


def _required(tls: TlsConfig | None) -> Authenticator:
    return Authenticator(AuthConfig(mode="required", internal_token=TOKEN, tls=tls), {})


async def _plan(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await router_pb2_grpc.RouterServiceStub(channel).Plan(plan_request("j", "hi"), timeout=5)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_an_internal_call_without_a_client_certificate_from_the_ca_is_refused(pki, tmp_path):
    stranger = local_ca.issue(tmp_path / "other-ca", ["client"])["client"]  # a certificate, another CA

    async def main():
        async with running(auth=_required(_tls(pki["router"]))) as server:
            certified = Channels(TOKEN, _tls(pki["client"]))
            plaintext = Channels(TOKEN)
            server_only = grpc.aio.secure_channel(  # trusts the CA, presents nothing
                server.target, grpc.ssl_channel_credentials(root_certificates=pki["client"].ca.read_bytes())
            )
            foreign = Channels(TOKEN, TlsConfig(pki["client"].ca.read_bytes(), *_pair(stranger)))
            try:
                assert await _plan(certified.service(server.target)) is grpc.StatusCode.OK
                assert await _plan(plaintext.service(server.target)) is grpc.StatusCode.UNAVAILABLE
                assert await _plan(server_only) is grpc.StatusCode.UNAVAILABLE
                assert await _plan(foreign.service(server.target)) is grpc.StatusCode.UNAVAILABLE
            finally:
                for channels in (certified, plaintext, foreign):
                    await channels.close()
                await server_only.close()

    asyncio.run(main())


def _pair(identity: local_ca.Identity) -> tuple[bytes, bytes]:
    return identity.cert.read_bytes(), identity.key.read_bytes()


def test_an_engine_is_reached_only_if_its_certificate_names_an_engine(pki):
    """Engines are called at the address they registered: a server there with another service's
    certificate (signed by the same CA) is not taken for an engine."""

    async def reach(identity: local_ca.Identity) -> grpc.StatusCode:
        async with running(auth=_required(_tls(identity))) as server:
            channels = Channels(TOKEN, _tls(pki["client"]))
            try:
                return await _plan(channels.replica(server.target))
            finally:
                await channels.close()

    assert asyncio.run(reach(pki["engine"])) is grpc.StatusCode.OK
    assert asyncio.run(reach(pki["router"])) is grpc.StatusCode.UNAVAILABLE


def test_the_container_health_check_presents_the_containers_certificate(pki, monkeypatch, capsys):
    """`python -m libs.healthcheck` (compose's health checks, Kubernetes' exec probes) asks a mutual
    TLS port with the EXPERT_TLS_* identity of its container; a gRPC probe, which has none, cannot."""

    async def main():
        async with running(auth=_required(_tls(pki["router"]))) as server:
            await server.health.set_serving(True)
            for name, value in pki["client"].env().items():
                monkeypatch.setenv(name, value)
            with_certificate = await asyncio.to_thread(healthcheck.main, [server.target])
            plaintext = await asyncio.to_thread(healthcheck.main, [server.target, "--plaintext"])
            return with_certificate, plaintext

    assert asyncio.run(main()) == (0, 1)
    assert any(line.endswith(": SERVING") for line in capsys.readouterr().out.splitlines())


def test_without_tls_the_internal_token_goes_only_to_a_loopback_address():
    assert is_loopback_target("127.0.0.1:50052") and is_loopback_target("[::1]:50052")
    assert not is_loopback_target("localhost:50052")  # a name may resolve anywhere
    assert not is_loopback_target("router:50052") and not is_loopback_target("10.0.0.7:50054")
    assert may_send_token("router:50052", TlsConfig(b"ca", b"cert", b"key"))
    assert not may_send_token("router:50052", None)

    async def main():
        # A server that checks the token (no TLS): the channel to its loopback address carries the
        # token, the one to the same server by name does not, and is refused for lacking it.
        async with running(auth=_required(None)) as server:
            port = server.target.rsplit(":", 1)[1]
            channels = Channels(TOKEN)
            try:
                assert await _plan(channels.service(f"127.0.0.1:{port}")) is grpc.StatusCode.OK
                assert await _plan(channels.service(f"localhost:{port}")) is grpc.StatusCode.UNAUTHENTICATED
            finally:
                await channels.close()

    asyncio.run(main())


def test_the_local_ca_writes_owner_only_files_and_never_its_own_key(tmp_path):
    identities = local_ca.issue(tmp_path / "tls", ["router", "client"], extra_hosts=["10.1.2.3"])
    directory = tmp_path / "tls"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = sorted(path.name for path in directory.iterdir())
    assert files == ["ca.pem", "client.key", "client.pem", "router.key", "router.pem"]
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert identities["router"].env() == {
        "EXPERT_TLS_CA": str(directory / "ca.pem"),
        "EXPERT_TLS_CERT": str(directory / "router.pem"),
        "EXPERT_TLS_KEY": str(directory / "router.key"),
    }


@pytest.mark.parametrize("service", ["reception", "router", "preparation", "engine", "postproc"])
def test_a_service_with_auth_required_and_no_certificate_refuses_to_start_naming_the_setting(
    service, tmp_path
):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EXPERT_")},
        "EXPERT_AUTH": "required",
        "EXPERT_INTERNAL_TOKEN": TOKEN,
        "EXPERT_DATA_DIR": str(tmp_path),
        # Were it to start anyway, on ports of its own choosing rather than a running stack's.
        f"EXPERT_{service.upper()}_PORT": "0",
        f"EXPERT_{service.upper()}_METRICS_PORT": "0",
        "EXPERT_RECEPTION_HTTP_PORT": "0",
    }
    finished = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = finished.stdout + finished.stderr
    assert finished.returncode == 1, output
    assert "EXPERT_TLS_CERT: required with EXPERT_AUTH=required" in output


def test_a_stack_makes_certificates_only_for_required_auth_without_given_ones(pki, tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("EXPERT_")]:
        monkeypatch.delenv(name)
    made = LocalStack(tmp_path / "made", env={"EXPERT_AUTH": "required"})
    assert set(made.identities()) == {*SERVICES, TRAINER, "client"} and made.client_credentials() is not None
    given = LocalStack(tmp_path / "given", env={"EXPERT_AUTH": "required", **pki["client"].env()})
    assert given.identities() == {} and given.client_credentials() is not None  # its own, for all
    assert not (tmp_path / "given" / "tls").exists()
    off = LocalStack(tmp_path / "off")
    assert off.identities() == {} and off.client_credentials() is None
