"""The TypeScript SDK (sdk/typescript) against a real stack: one stack on the tiny model with
EXPERT_AUTH=required, an admin key made with the internal token, and the SDK's own tests
(`npm test`, node's test runner) run against it: directly on reception's (plaintext) client port,
and with the SDK's `tls` option through a mutual-TLS ingress with a certificate of the stack's own
CA (tests/helpers/tls_ingress.py). `make test` installs node and builds the SDK first
(`make sdk-typescript`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import grpc

from libs.auth.metadata import credentials_metadata
from libs.config import TlsConfig
from libs.gen.expert.v1 import keys_pb2, keys_pb2_grpc
from tests.conftest import REPO
from tests.e2e.conftest import ready_tiny_stack
from tests.helpers.tls_ingress import tls_ingress
from tools.stack import CLIENT_IDENTITY

SDK = REPO / "sdk" / "typescript"
TOKEN = "e2e-internal-token-typescript-0123456789"


def _admin_key(target: str) -> str:
    """An admin key, made with the internal token as an operator makes the first key."""
    with grpc.insecure_channel(target) as channel:
        response = keys_pb2_grpc.KeyServiceStub(channel).CreateKey(
            keys_pb2.CreateKeyRequest(name="typescript sdk admin", scope=keys_pb2.KEY_SCOPE_ADMIN),
            metadata=credentials_metadata(internal_token=TOKEN),
            timeout=10,
        )
    return response.secret


def test_the_typescript_sdk_passes_its_tests_against_a_real_stack(tiny_llama, tmp_path):
    npm = shutil.which("npm")
    assert npm, "npm is missing: `make sdk-typescript` installs node and npm"
    assert (SDK / "dist" / "index.js").exists(), "the SDK is not built: run `make sdk-typescript`"
    settings = {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": TOKEN}
    with ready_tiny_stack(tiny_llama, tmp_path / "stack", **settings) as stack:
        target = stack.target("reception")
        identities = stack.identities()  # the stack's CA: a certificate per service, and a client's
        ingress_tls = TlsConfig.from_env(identities["reception"].env())
        with tls_ingress(target, ingress_tls) as tls_target:
            client = identities[CLIENT_IDENTITY]
            env = os.environ | {
                "EXPERT_RECEPTION_TARGET": target,
                "EXPERT_API_KEY": _admin_key(target),
                "EXPERT_TLS_TARGET": tls_target,
                "EXPERT_TLS_CA": str(client.ca),
                "EXPERT_TLS_CERT": str(client.cert),
                "EXPERT_TLS_KEY": str(client.key),
            }
            run = subprocess.run(
                [npm, "test"], cwd=SDK, env=env, capture_output=True, text=True, timeout=300, check=False
            )
    output = run.stdout + run.stderr
    print(output)  # the runner's report, with each test's duration (shown with -s, or on failure)
    assert run.returncode == 0, output
    # node's runner closes with "# tests N" and "# pass N": every test ran and passed.
    tests, passed = (re.search(rf"^# {word} (\d+)$", output, re.MULTILINE) for word in ("tests", "pass"))
    assert tests and passed and int(tests[1]) >= 16 and passed[1] == tests[1], output
