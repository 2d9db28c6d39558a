"""gRPC credentials for mutual TLS between the services, and the rule for the internal token.

With a TLS identity (libs.config.TlsConfig: EXPERT_TLS_CA, EXPERT_TLS_CERT, EXPERT_TLS_KEY) every
internal port asks each caller for a certificate signed by the CA, and every internal channel
presents the service's own and checks the peer's against the CA and the name it dialled. Without
one, the internal token is sent only to a loopback address (127.0.0.0/8 or ::1), which no other
machine can listen on: `may_send_token` is the one place that decides.
"""

from __future__ import annotations

import ipaddress

import grpc

from libs.config import TlsConfig

# The name every engine's certificate carries. Engines are called at the address they registered
# (a pod IP, which no certificate can name in advance), so their channels check this name instead:
# a process with another service's certificate cannot pose as an engine.
ENGINE_TLS_NAME = "engine"


def server_credentials(tls: TlsConfig, *, client_auth: bool = True) -> grpc.ServerCredentials:
    """The server side: the service's certificate, and with `client_auth` a certificate signed by
    the CA required of every caller (a caller without one fails the handshake: UNAVAILABLE)."""
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=client_auth
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """The client side: trusts only the CA and presents the service's own certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


def is_loopback_target(target: str) -> bool:
    """Whether `target` (host:port) names a loopback address literally: 127.x.x.x or [::1]. A name
    (even `localhost`) is not, since a resolver may answer with any address."""
    host = target.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def may_send_token(target: str, tls: TlsConfig | None) -> bool:
    """Whether a channel to `target` may carry the internal token: only inside mutual TLS, or to a
    loopback address when there is no TLS (a local stack with auth off)."""
    return tls is not None or is_loopback_target(target)
