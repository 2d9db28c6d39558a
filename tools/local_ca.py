"""A certificate authority for one machine's stack: what `expertctl up` (tools.stack) makes when
EXPERT_AUTH=required, so that the services call each other over mutual TLS (libs.tls).

`issue(directory, names)` makes a CA and, for each name, a certificate signed by it whose names are
the service's own (`router`: what compose and Kubernetes call it) and the loopback ones
(`localhost`, 127.0.0.1, ::1: what a local stack dials), plus `extra_hosts`. Every file is written
owner-only (0600) in an owner-only directory (0700). The CA's private key is never written: once the
certificates are made nothing on disk can sign another one, so a local process that cannot read the
directory cannot join the mesh. Keys are ECDSA P-256 (fast to make, as strong as RSA-3072).

`python -m tools.local_ca DIR [--host NAME]... [--keep]` does the same from a shell, for the five
services, the trainer and `client` (the operator's certificate, for `expertctl` and probes):
compose.yaml runs it once into its `tls` volume (`--keep`: not again while DIR has a CA, so that a
restarted service finds the certificates its peers trust).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE = "ca.pem"
# Whom `python -m tools.local_ca` issues for: the services (tools.stack.SERVICES; tools.stack
# imports this module), the trainer worker (tools.stack.TRAINER) and the operator.
NAMES = ("router", "preparation", "postproc", "engine", "reception", "trainer", "client")
VALIDITY = datetime.timedelta(days=365)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_OWNER_ONLY_DIR = 0o700
_OWNER_ONLY_FILE = 0o600


@dataclass(frozen=True)
class Identity:
    """The files of one certificate: what EXPERT_TLS_CA, EXPERT_TLS_CERT and EXPERT_TLS_KEY name."""

    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        return {
            "EXPERT_TLS_CA": str(self.ca),
            "EXPERT_TLS_CERT": str(self.cert),
            "EXPERT_TLS_KEY": str(self.key),
        }


def issue(directory: Path, names: Iterable[str], extra_hosts: Iterable[str] = ()) -> dict[str, Identity]:
    """A new CA and one certificate per name in `directory` (created owner-only; earlier files are
    replaced), for servers and clients alike; returns each name's files."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(_OWNER_ONLY_DIR)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key)
    ca_path = _write(directory / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM))
    hosts = [*LOOPBACK_NAMES, *extra_hosts]
    identities = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _leaf_certificate(name, [name, *hosts], key, ca_cert, ca_key)
        identities[name] = Identity(
            ca=ca_path,
            cert=_write(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(directory / f"{name}.key", _private_bytes(key)),
        )
    return identities


def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expert-system local CA")])
    return (
        _builder(subject, key.public_key(), subject)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )


def _leaf_certificate(
    name: str,
    hosts: list[str],
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return (
        _builder(subject, key.public_key(), ca_cert.subject)
        .add_extension(
            x509.SubjectAlternativeName([_general_name(host) for host in dict.fromkeys(hosts)]), False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def _builder(subject: x509.Name, public_key, issuer: x509.Name) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a clock a little behind still accepts it
        .not_valid_after(now + VALIDITY)
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def _private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes) -> Path:
    """`data` in a new file at `path`, created owner-only (never readable by others, not even for a
    moment)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _OWNER_ONLY_FILE)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.local_ca", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the CA and the certificates go (made 0700)")
    parser.add_argument(
        "--host", action="append", default=[], help="another name or address every certificate carries"
    )
    parser.add_argument("--keep", action="store_true", help="do nothing when the directory already has a CA")
    args = parser.parse_args(argv)
    if args.keep and (args.directory / CA_FILE).exists():
        print(f"{args.directory}: kept the certificates already there")
        return 0
    issue(args.directory, NAMES, args.host)
    print(f"{args.directory}: a CA and certificates for {', '.join(NAMES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
