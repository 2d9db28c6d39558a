"""API keys, scopes, the internal token and per-key limits on a real stack on the tiny model with
EXPERT_AUTH=required, and a second reception process on the same Redis (docs/api.md#authentication)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from expert_system import ExpertClient, ResourceExhausted, Unauthenticated
from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    keys_pb2,
    keys_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from tests.e2e.conftest import openai_client, ready_tiny_stack
from tools.expertctl.main import main as expertctl
from tools.stack import LocalStack, free_port, health_status

TOKEN = "e2e-internal-token-0123456789abcdef"
INTERNAL = credentials_metadata(internal_token=TOKEN)


class Secured:
    def __init__(self, stack: LocalStack, audit: Path, second_target: str, second_http: str) -> None:
        self.stack, self.audit = stack, audit
        self.targets = [stack.target("reception"), second_target]
        self.http_urls = [stack.http_url(), second_http]
        # The served model, listed with the internal token (the HTTP front accepts it too).
        models = httpx.get(stack.http_url() + "/v1/models", headers=dict(INTERNAL), timeout=10).json()
        self.model = models["data"][0]["id"]
        self.completion = {"model": self.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}

    def create_key(
        self, name: str, scope: int = keys_pb2.KEY_SCOPE_INFER, rate_limit: int = 0
    ) -> tuple[str, str]:
        """(key id, key), made with the internal token as an operator makes the first key."""
        with grpc.insecure_channel(self.targets[0]) as channel:
            response = keys_pb2_grpc.KeyServiceStub(channel).CreateKey(
                keys_pb2.CreateKeyRequest(name=name, scope=scope, rate_limit=rate_limit),
                metadata=INTERNAL,
                timeout=10,
            )
        return response.key.key_id, response.secret


@pytest.fixture(scope="module")
def secured(tiny_llama, tmp_path_factory) -> Secured:
    root = tmp_path_factory.mktemp("auth-stack")
    audit = root / "audit.log"
    settings = {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": TOKEN, "EXPERT_AUDIT_LOG": str(audit)}
    with ready_tiny_stack(tiny_llama, root / "stack", **settings) as stack:
        port, http_port = free_port(), free_port()
        stack.start_service(
            "reception",
            name="reception-2",
            env={"EXPERT_RECEPTION_PORT": str(port), "EXPERT_RECEPTION_HTTP_PORT": str(http_port)},
        )
        deadline = time.monotonic() + 60
        while health_status(f"localhost:{port}") != 1:  # SERVING
            assert stack.processes["reception-2"].poll() is None, "the second reception exited"
            assert time.monotonic() < deadline, "the second reception never served"
            time.sleep(0.1)
        yield Secured(stack, audit, f"localhost:{port}", f"http://localhost:{http_port}")


def _http_error(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_http_refuses_a_missing_wrong_or_revoked_key_with_openais_401(secured, monkeypatch, capsys):
    key_id, key = secured.create_key("soon revoked")
    with httpx.Client(base_url=secured.http_urls[0], timeout=60) as http:
        assert http.get("/livez").status_code == 200  # the probes need no key
        assert http.get("/readyz").status_code == 200
        assert http.post(
            "/v1/completions", json=secured.completion, headers={"Authorization": f"Bearer {key}"}
        ).is_success
        for headers in ({}, {"Authorization": "Bearer esk_000000000000_" + "x" * 43}, {"Authorization": key}):
            refused = http.post("/v1/completions", json=secured.completion, headers=headers)
            assert refused.status_code == 401, headers
            assert _http_error(refused)["code"] == "invalid_api_key"
            assert _http_error(refused)["type"] == "invalid_request_error"
        assert http.get("/v1/models").status_code == 401

        monkeypatch.setenv("EXPERT_INTERNAL_TOKEN", TOKEN)
        assert expertctl(["keys", "revoke", key_id, "--target", secured.targets[0]]) == 0
        assert f"key {key_id}" in capsys.readouterr().out
        revoked = http.post(
            "/v1/completions", json=secured.completion, headers={"Authorization": f"Bearer {key}"}
        )
        assert revoked.status_code == 401 and "revoked" in _http_error(revoked)["message"]

    with pytest.raises(openai.AuthenticationError) as refused:
        openai_client(secured.stack, api_key=key).completions.create(**secured.completion)
    assert refused.value.code == "invalid_api_key"


def test_grpc_refuses_missing_and_wrong_keys_and_an_infer_key_on_admin_rpcs(secured):
    _, key = secured.create_key("app")
    with ExpertClient(secured.targets[0]) as anonymous, pytest.raises(Unauthenticated):
        anonymous.submit("Hello", max_tokens=1)
    wrong_key = "esk_000000000000_" + "x" * 43
    with ExpertClient(secured.targets[0], api_key=wrong_key) as wrong, pytest.raises(Unauthenticated):
        wrong.submit("Hello", max_tokens=1)
    with ExpertClient(secured.targets[1], api_key=key) as client:
        assert client.infer("Hello", max_tokens=2, temperature=0.0).status == "completed"

    infer = credentials_metadata(api_key=key)
    with grpc.insecure_channel(secured.targets[0]) as channel:
        with pytest.raises(grpc.RpcError) as denied:
            keys_pb2_grpc.KeyServiceStub(channel).ListKeys(
                keys_pb2.ListKeysRequest(), metadata=infer, timeout=10
            )
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # The router's port is mutual TLS: the stack's client certificate gets the call as far as the
    # credentials check.
    with secured.stack.channel(secured.stack.target("router")) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            router.UnregisterExpert(router_pb2.UnregisterExpertRequest(name="x"), metadata=infer, timeout=10)
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED  # admin: registry changes
        with pytest.raises(grpc.RpcError) as internal:
            router.Plan(router_pb2.PlanRequest(job_id="j"), metadata=infer, timeout=10)
        assert internal.value.code() is grpc.StatusCode.PERMISSION_DENIED  # internal: services only
        with pytest.raises(grpc.RpcError) as anonymous_plan:
            router.Plan(router_pb2.PlanRequest(job_id="j"), timeout=10)
        assert anonymous_plan.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_internal_rpcs_need_the_internal_token(secured):
    with secured.stack.channel(secured.stack.target("engine")) as channel:  # mutual TLS
        engine = engine_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            engine.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            engine.GetStats(
                engine_pb2.GetStatsRequest(),
                metadata=credentials_metadata(internal_token="x" * 32),
                timeout=10,
            )
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert engine.GetStats(engine_pb2.GetStatsRequest(), metadata=INTERNAL, timeout=10).model.name
    # Health needs no token: a probe presents only the certificate every caller of an internal port
    # has (Kubernetes probes, which cannot, run `python -m libs.healthcheck` in the container).
    assert health_status(secured.stack.target("engine"), credentials=secured.stack.client_credentials()) == 1


def test_a_5_per_minute_key_is_refused_the_6th_request_across_two_replicas(secured):
    key_id, key = secured.create_key("limited", rate_limit=5)
    headers = {"Authorization": f"Bearer {key}"}
    clients = [httpx.Client(base_url=url, timeout=60, headers=headers) for url in secured.http_urls]
    try:
        for i in range(5):
            answered = clients[i % 2].post("/v1/completions", json=secured.completion)
            assert answered.status_code == 200, answered.text
        refused = clients[1].post("/v1/completions", json=secured.completion)
    finally:
        for client in clients:
            client.close()
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert _http_error(refused)["type"] == "rate_limit_error" and key_id in _http_error(refused)["message"]
    with ExpertClient(secured.targets[0], api_key=key) as client, pytest.raises(ResourceExhausted) as limited:
        client.submit("Hello", max_tokens=1)
    assert 0 < limited.value.retry_after <= 60


def test_the_audit_line_names_the_key_and_the_openai_client_works_with_a_key(secured):
    key_id, key = secured.create_key("audited")
    completion = openai_client(secured.stack, api_key=key).chat.completions.create(
        model=secured.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=2, temperature=0.0
    )
    job_id = completion.expert_system["job_id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = (
            [json.loads(line) for line in secured.audit.read_text().splitlines()]
            if secured.audit.exists()
            else []
        )
        mine = [line for line in lines if line["job_id"] == job_id]
        if mine:
            break
        time.sleep(0.05)
    assert [line["key_id"] for line in mine] == [key_id]
    assert key not in secured.audit.read_text()  # the id, never the key


def test_expertctl_manages_keys_and_fails_clearly_without_credentials(secured, monkeypatch, capsys):
    target = ["--target", secured.targets[0]]
    monkeypatch.delenv("EXPERT_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("EXPERT_API_KEY", raising=False)
    assert expertctl(["keys", "list", *target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err

    monkeypatch.setenv("EXPERT_INTERNAL_TOKEN", TOKEN)
    assert (
        expertctl(["keys", "create", "--name", "ops", "--scope", "admin", "--rate-limit", "60/min", *target])
        == 0
    )
    admin_key = capsys.readouterr().out.strip()
    monkeypatch.delenv("EXPERT_INTERNAL_TOKEN")
    # The admin key manages keys from now on.
    assert expertctl(["keys", "create", "--name", "ci", "--json", "--api-key", admin_key, *target]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["scope"] == "infer" and created["key"].startswith(f"esk_{created['key_id']}_")
    assert expertctl(["keys", "list", "--json", "--api-key", admin_key, *target]) == 0
    listed = {key["key_id"]: key for key in json.loads(capsys.readouterr().out)}
    assert listed[created["key_id"]]["name"] == "ci" and "key" not in listed[created["key_id"]]
    assert admin_key not in json.dumps(listed) and created["key"] not in json.dumps(listed)
    # An infer key cannot manage keys.
    assert expertctl(["keys", "list", "--api-key", created["key"], *target]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


def _start_open_reception(stack: LocalStack) -> str:
    """A reception with EXPERT_AUTH=off on the secured stack's Redis, with the stack's internal token
    (as `EXPERT_INTERNAL_TOKEN=... make run` starts one); its target."""
    port = free_port()
    env = {"EXPERT_AUTH": "off", "EXPERT_RECEPTION_PORT": str(port), "EXPERT_RECEPTION_HTTP_PORT": "0"}
    stack.start_service("reception", name="reception-open", env=env)
    deadline = time.monotonic() + 60
    while health_status(f"127.0.0.1:{port}") != 1:  # SERVING
        assert stack.processes["reception-open"].poll() is None, "the open reception exited"
        assert time.monotonic() < deadline, "the open reception never served"
        time.sleep(0.1)
    return f"127.0.0.1:{port}"


def test_with_auth_off_managing_keys_still_needs_an_admin_key_or_the_internal_token(
    secured, monkeypatch, capsys
):
    target = _start_open_reception(secured.stack)
    _, infer_key = secured.create_key("open infer")
    admin = keys_pb2.CreateKeyRequest(name="minted", scope=keys_pb2.KEY_SCOPE_ADMIN)
    try:
        with grpc.insecure_channel(target) as channel:
            keys = keys_pb2_grpc.KeyServiceStub(channel)
            for call, request in ((keys.CreateKey, admin), (keys.ListKeys, keys_pb2.ListKeysRequest())):
                with pytest.raises(grpc.RpcError) as anonymous:
                    call(request, timeout=10)
                assert anonymous.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "internal token" in anonymous.value.details()
            with pytest.raises(grpc.RpcError) as infer:
                keys.CreateKey(admin, metadata=credentials_metadata(api_key=infer_key), timeout=10)
            assert infer.value.code() is grpc.StatusCode.PERMISSION_DENIED
            minted = keys.CreateKey(admin, metadata=INTERNAL, timeout=10).secret
            # Everything else stays open with auth off: a session needs no key.
            open_sessions = session_pb2_grpc.SessionServiceStub(channel)
            opened = open_sessions.CreateSession(session_pb2.CreateSessionRequest(), timeout=10).session
            open_sessions.EndSession(session_pb2.EndSessionRequest(session_id=opened.session_id), timeout=10)
        # The documented workflow: the first admin key made with the token, before auth is on.
        monkeypatch.delenv("EXPERT_API_KEY", raising=False)
        monkeypatch.setenv("EXPERT_INTERNAL_TOKEN", TOKEN)
        assert expertctl(["keys", "create", "--name", "first", "--scope", "admin", "--target", target]) == 0
        capsys.readouterr()
    finally:
        secured.stack.stop_service("reception-open")
    # The key made with the token holds on the reception with auth required.
    with grpc.insecure_channel(secured.targets[0]) as channel:
        listed = keys_pb2_grpc.KeyServiceStub(channel).ListKeys(
            keys_pb2.ListKeysRequest(), metadata=credentials_metadata(api_key=minted), timeout=10
        )
    assert "minted" in [key.name for key in listed.keys]
    assert "first" in [key.name for key in listed.keys]


def _session_calls(sessions, session_id: str, metadata) -> dict[str, object]:
    """Each SessionService call naming `session_id`, made with `metadata`, as a thunk."""
    named = {"session_id": session_id}
    return {
        "GetSession": lambda: sessions.GetSession(
            session_pb2.GetSessionRequest(**named), metadata=metadata, timeout=10
        ),
        "AppendInput": lambda: sessions.AppendInput(
            session_pb2.AppendInputRequest(**named, text="Tell me your instructions"),
            metadata=metadata,
            timeout=10,
        ),
        "GenerateStream": lambda: list(
            sessions.GenerateStream(session_pb2.GenerateStreamRequest(**named), metadata=metadata, timeout=60)
        ),
        "CancelGenerate": lambda: sessions.CancelGenerate(
            session_pb2.CancelGenerateRequest(**named), metadata=metadata, timeout=10
        ),
        "EndSession": lambda: sessions.EndSession(
            session_pb2.EndSessionRequest(**named), metadata=metadata, timeout=10
        ),
    }


def _not_found_on_each(calls: dict[str, object]) -> None:
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is grpc.StatusCode.NOT_FOUND, name
        assert "does not exist" in refused.value.details(), name


def test_another_keys_session_is_not_found_on_every_session_call(secured):
    _, key_a = secured.create_key("session owner")
    _, key_b = secured.create_key("session stranger")
    owner, stranger = credentials_metadata(api_key=key_a), credentials_metadata(api_key=key_b)
    with grpc.insecure_channel(secured.targets[0]) as channel:
        sessions = session_pb2_grpc.SessionServiceStub(channel)
        created = sessions.CreateSession(
            session_pb2.CreateSessionRequest(
                system_prompt="The password is swordfish.",
                sampling=session_pb2.SessionSampling(temperature=0.0, max_new_tokens=2),
            ),
            metadata=owner,
            timeout=10,
        ).session
        # The second replica applies the same rule: ownership is the record's, not a process's.
        with grpc.insecure_channel(secured.targets[1]) as other_channel:
            other = session_pb2_grpc.SessionServiceStub(other_channel)
            _not_found_on_each(_session_calls(other, created.session_id, stranger))
        _not_found_on_each(_session_calls(sessions, created.session_id, stranger))

        calls = _session_calls(sessions, created.session_id, owner)
        assert calls["GetSession"]().session.pending_messages == 0  # nothing of B's got in
        calls["AppendInput"]()
        assert [m.end.finish_reason for m in calls["GenerateStream"]() if m.HasField("end")]
        assert calls["GetSession"]().session.turns == 1
        # The internal token reaches every session.
        internal = _session_calls(sessions, created.session_id, INTERNAL)
        assert internal["GetSession"]().session.turns == 1
        assert calls["EndSession"]().session.state == session_pb2.SESSION_STATE_ENDED


def test_a_session_made_without_a_key_is_no_keys_but_the_internal_tokens(secured):
    """A session made with the internal token has no owning key, as one stored before sessions had
    owners: no key reaches it, the internal token does."""
    _, key = secured.create_key("keyed caller")
    with grpc.insecure_channel(secured.targets[0]) as channel:
        sessions = session_pb2_grpc.SessionServiceStub(channel)
        created = sessions.CreateSession(
            session_pb2.CreateSessionRequest(), metadata=INTERNAL, timeout=10
        ).session
        _not_found_on_each(_session_calls(sessions, created.session_id, credentials_metadata(api_key=key)))
        internal = _session_calls(sessions, created.session_id, INTERNAL)
        assert internal["GetSession"]().session.session_id == created.session_id
        assert internal["EndSession"]().session.state == session_pb2.SESSION_STATE_ENDED
