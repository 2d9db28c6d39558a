"""`python -m libs.healthcheck HOST:PORT [--service NAME] [--timeout S] [--plaintext]`: one
grpc.health.v1 check.

Container health checks (compose.yaml) and Kubernetes' exec probes run it inside a service's own
container against its own port. When the container has a TLS identity (EXPERT_TLS_CA,
EXPERT_TLS_CERT, EXPERT_TLS_KEY), it checks over mutual TLS with it, as the service's port asks
of every caller; `--plaintext` checks without (reception's public port). It asks once and answers
with its exit status: 0 only when the server says SERVING; 1 when it says anything else
(NOT_SERVING while the engine loads its model, or during a graceful stop), does not know the
service, or does not answer in time; 2 for bad usage (or unreadable TLS files). It never waits or
retries: the orchestrator's interval and retries decide how patient to be.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.config import ConfigError, TlsConfig
from libs.tls import channel_credentials

DEFAULT_TIMEOUT_S = 3.0


def check(
    target: str, service: str = "", timeout: float = DEFAULT_TIMEOUT_S, tls: TlsConfig | None = None
) -> str:
    """The status `target` reports for `service` ("" for the whole server), e.g. "SERVING", or the
    gRPC status code's name (e.g. "UNAVAILABLE", "NOT_FOUND") when the check itself fails; over
    mutual TLS with `tls`."""
    channel = (
        grpc.insecure_channel(target)
        if tls is None
        else grpc.secure_channel(target, channel_credentials(tls))
    )
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.healthcheck", description=__doc__)
    parser.add_argument("target", metavar="HOST:PORT", help="the gRPC server to ask")
    parser.add_argument("--service", default="", help='a full service name (default "": the whole server)')
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the answer"
    )
    parser.add_argument(
        "--plaintext", action="store_true", help="no TLS, even with EXPERT_TLS_* set (a public port)"
    )
    args = parser.parse_args(argv)
    try:
        tls = None if args.plaintext else TlsConfig.from_env()
    except ConfigError as error:
        print(f"{args.target}: {error}")
        return 2
    status = check(args.target, args.service, args.timeout, tls)
    what = f"{args.target} {args.service}".rstrip()
    # One line either way: `docker inspect` shows it as the check's output.
    print(f"{what}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
