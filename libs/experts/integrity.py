"""What a package's signature covers, and how it is checked.

`checksums.sha256` lists the sha256 of every payload file (manifest, PEFT config, weights) in
`sha256sum` format, sorted by path; `signature.json` holds an ed25519 signature over the exact bytes
of that list. So one signature covers every byte of the payload, and `sha256sum -c` can check the
files of an unpacked package by hand.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from libs.experts.errors import PackageError
from libs.experts.jsonio import dumps_canonical, loads_strict
from libs.experts.signing import Keyring, key_id

MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHECKSUMS_FILE = "checksums.sha256"
SIGNATURE_FILE = "signature.json"
PAYLOAD_FILES = tuple(sorted((MANIFEST_FILE, CONFIG_FILE, WEIGHTS_FILE)))
ALGORITHM = "ed25519"
_CHECKSUM_LINE_RE = re.compile(r"([0-9a-f]{64})  (\S+)")
_KEY_ID_RE = re.compile(r"[0-9a-f]{16}")
_SIGNATURE_KEYS = ("algorithm", "key_id", "signature")


@dataclass(frozen=True)
class Signature:
    """A parsed `signature.json`: which key signed, and the 64 signature bytes."""

    key_id: str
    signature: bytes


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def format_checksums(files: Mapping[str, bytes]) -> bytes:
    """`checksums.sha256` for `files`: `<sha256>  <name>` lines sorted by name."""
    return "".join(f"{sha256_hex(files[name])}  {name}\n" for name in sorted(files)).encode("ascii")


def parse_checksums(data: bytes) -> dict[str, str]:
    """The sha256 of each payload file as `checksums.sha256` lists it; refuses any other format, an
    unsorted list, or a list that is not exactly the payload files."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise PackageError(f"{CHECKSUMS_FILE}: not ASCII text") from None
    if not text.endswith("\n"):
        raise PackageError(f"{CHECKSUMS_FILE}: does not end with a newline")
    listed: dict[str, str] = {}
    for number, line in enumerate(text[:-1].split("\n"), start=1):
        match = _CHECKSUM_LINE_RE.fullmatch(line)
        if match is None:
            raise PackageError(f"{CHECKSUMS_FILE}: line {number} is not '<sha256>  <file>'")
        digest, name = match.groups()
        if name not in PAYLOAD_FILES:
            raise PackageError(f"{CHECKSUMS_FILE}: lists {name!r}, which is not a payload file")
        if name in listed:
            raise PackageError(f"{CHECKSUMS_FILE}: lists {name!r} twice")
        listed[name] = digest
    for name in PAYLOAD_FILES:
        if name not in listed:
            raise PackageError(f"{CHECKSUMS_FILE}: does not list {name!r}")
    if list(listed) != sorted(listed):
        raise PackageError(f"{CHECKSUMS_FILE}: not sorted by path")
    return listed


def sign_checksums(private_key: Ed25519PrivateKey, checksums: bytes) -> bytes:
    """`signature.json` for the `checksums.sha256` bytes, signed with `private_key`."""
    document = {
        "algorithm": ALGORITHM,
        "key_id": key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(checksums)).decode("ascii"),
    }
    return dumps_canonical(document)


def parse_signature(data: bytes) -> Signature:
    """The key id and signature bytes of `signature.json`; refuses anything but exactly the three
    keys, the ed25519 algorithm, a 16-hex-digit key id and a 64-byte base64 signature."""
    try:
        raw = loads_strict(data)
    except ValueError as exc:
        raise PackageError(f"{SIGNATURE_FILE}: {exc}") from None
    if not isinstance(raw, dict) or sorted(raw) != list(_SIGNATURE_KEYS):
        raise PackageError(f"{SIGNATURE_FILE}: must be an object with exactly {', '.join(_SIGNATURE_KEYS)}")
    if raw["algorithm"] != ALGORITHM:
        raise PackageError(
            f"{SIGNATURE_FILE}: algorithm {raw['algorithm']!r} is not supported (only {ALGORITHM})"
        )
    if not isinstance(raw["key_id"], str) or not _KEY_ID_RE.fullmatch(raw["key_id"]):
        raise PackageError(f"{SIGNATURE_FILE}: key_id {raw['key_id']!r} is not 16 lowercase hex digits")
    try:
        signature = base64.b64decode(raw["signature"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise PackageError(f"{SIGNATURE_FILE}: signature is not base64") from None
    if len(signature) != 64:
        raise PackageError(f"{SIGNATURE_FILE}: signature is {len(signature)} bytes, not 64")
    return Signature(raw["key_id"], signature)


def verify_signature(signature: Signature, checksums: bytes, keyring: Keyring) -> None:
    """Check that a key of `keyring` signed the `checksums.sha256` bytes; a `PackageError` names the
    key otherwise (unknown to the keyring, or not the signer)."""
    public_key = keyring.get(signature.key_id)
    if public_key is None:
        empty = " (which holds no keys)" if len(keyring) == 0 else ""
        raise PackageError(
            f"{SIGNATURE_FILE}: signed by key {signature.key_id} which is not in the trusted keyring "
            f"{keyring.source}{empty}"
        )
    try:
        public_key.verify(signature.signature, checksums)
    except InvalidSignature:
        raise PackageError(
            f"{SIGNATURE_FILE}: signature does not verify with key {signature.key_id}"
        ) from None
