"""`.expert` packages: build, write and read (verified) one expert as a single signed file.

A package is a gzip-compressed tar of exactly five files: `manifest.json`, `adapter_config.json`
(PEFT's, kept for round trips), `adapter_model.safetensors` (the weights, with PEFT's key names),
`checksums.sha256` and `signature.json` (see `integrity.py`). Reading is all in memory and in an
order that trusts nothing unverified: the container's shape, then the signature over the checksum
list, then every file's sha256, and only then the manifest, the PEFT config and the tensors.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from libs.experts.archive import write_tar_gz
from libs.experts.contents import (
    DEFAULT_MAX_BYTES,
    PACKAGE_FILES,
    SMALL_FILE_LIMIT,
    check_payload,
    load_package_files,
    load_source,
    parse_json_file,
    parse_manifest,
)
from libs.experts.errors import PackageError
from libs.experts.inspection import PackageInfo, inspect_package
from libs.experts.integrity import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    MANIFEST_FILE,
    PAYLOAD_FILES,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    format_checksums,
    parse_checksums,
    parse_signature,
    sha256_hex,
    sign_checksums,
    verify_signature,
)
from libs.experts.jsonio import dumps_canonical
from libs.experts.manifest import Manifest
from libs.experts.signing import Keyring

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PACKAGE_FILES",
    "PACKAGE_SUFFIX",
    "PackageError",
    "PackageInfo",
    "VerifiedPackage",
    "build_package",
    "inspect_package",
    "read_package",
    "write_package",
]

PACKAGE_SUFFIX = ".expert"


@dataclass(frozen=True)
class VerifiedPackage:
    """A package whose signature, checksums, manifest, PEFT config and safetensors header all
    passed `read_package`. `content_hash` is the sha256 of `checksums.sha256`, hence of the whole
    payload; `key_id` names the trusted key that signed it; `size` is the package's byte count."""

    manifest: Manifest
    adapter_config: dict[str, Any]
    weights: bytes
    content_hash: str
    key_id: str
    size: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by PEFT key name, on the CPU, in their stored dtype."""
        from safetensors.torch import load

        return load(self.weights)


def build_package(
    manifest: Manifest, adapter_config: dict[str, Any], weights: bytes, private_key: Ed25519PrivateKey
) -> bytes:
    """The bytes of a package of `manifest`, the PEFT `adapter_config` and the safetensors `weights`,
    signed with `private_key`. Deterministic: the same inputs give the same bytes. Refuses (with a
    `PackageError`) what `read_package` would refuse, so a built package always reads back."""
    if not isinstance(manifest, Manifest):
        raise PackageError(f"{MANIFEST_FILE}: expected a Manifest, got {type(manifest).__name__}")
    if not isinstance(private_key, Ed25519PrivateKey):
        raise PackageError(
            f"{SIGNATURE_FILE}: expected an ed25519 private key, got {type(private_key).__name__}"
        )
    try:
        config_bytes = dumps_canonical(adapter_config)
    except (TypeError, ValueError) as exc:
        raise PackageError(f"{CONFIG_FILE}: not serializable as JSON ({exc})") from None
    weights = bytes(weights)
    check_payload(manifest, adapter_config, weights)
    payload = {MANIFEST_FILE: manifest.to_json_bytes(), CONFIG_FILE: config_bytes, WEIGHTS_FILE: weights}
    for name in (MANIFEST_FILE, CONFIG_FILE):
        if len(payload[name]) > SMALL_FILE_LIMIT:
            raise PackageError(
                f"{name}: {len(payload[name])} bytes, more than the limit of {SMALL_FILE_LIMIT}"
            )
    checksums = format_checksums(payload)
    files = {**payload, CHECKSUMS_FILE: checksums, SIGNATURE_FILE: sign_checksums(private_key, checksums)}
    return write_tar_gz([(name, files[name]) for name in PACKAGE_FILES])


def write_package(path: str | PathLike[str], data: bytes) -> Path:
    """Write package bytes to `path` atomically (a temporary file in the same directory, then a
    rename), so a reader never sees half a package. Returns the path."""
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def read_package(
    source: bytes | str | PathLike[str], keyring: Keyring, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> VerifiedPackage:
    """Read and verify a package (bytes or a path) against the trusted `keyring`, all in memory.
    Any problem is a `PackageError` naming it: the container (not gzip, truncated, unsafe or
    unexpected members, over `max_bytes`), the checksum list, the signature (unknown key, does not
    verify), a file's sha256, the manifest, the PEFT config or the safetensors header."""
    data = load_source(source, max_bytes)
    files = load_package_files(data, max_bytes=max_bytes)
    checksums = files[CHECKSUMS_FILE]
    listed = parse_checksums(checksums)
    signature = parse_signature(files[SIGNATURE_FILE])
    verify_signature(signature, checksums, keyring)
    for name in PAYLOAD_FILES:
        if sha256_hex(files[name]) != listed[name]:
            raise PackageError(f"{name}: checksum mismatch")
    # From here on every byte is the signer's.
    manifest = parse_manifest(files[MANIFEST_FILE])
    adapter_config = parse_json_file(CONFIG_FILE, files[CONFIG_FILE])
    check_payload(manifest, adapter_config, files[WEIGHTS_FILE])
    return VerifiedPackage(
        manifest=manifest,
        adapter_config=adapter_config,
        weights=files[WEIGHTS_FILE],
        content_hash=sha256_hex(checksums),
        key_id=signature.key_id,
        size=len(data),
    )
