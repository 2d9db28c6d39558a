"""What is inside a `.expert` package, without a keyring: `inspect_package`.

For people and for planning (the router's VRAM penalty, the preparation service's budget), not for
trust: the signing key is reported as the package claims it, unverified, and a checksum mismatch is
reported rather than refused. The container must still be well formed and the manifest valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any

from libs.experts.contents import (
    DEFAULT_MAX_BYTES,
    PACKAGE_FILES,
    load_package_files,
    load_source,
    parse_manifest,
)
from libs.experts.errors import PackageError
from libs.experts.integrity import (
    CHECKSUMS_FILE,
    MANIFEST_FILE,
    PAYLOAD_FILES,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    parse_checksums,
    parse_signature,
    sha256_hex,
)
from libs.experts.manifest import Manifest
from libs.experts.peft_adapter import parse_tensors
from libs.experts.safetensors_header import TensorInfo

# Bytes per parameter of the dtypes an engine may hold adapter weights in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class FileInfo:
    """One file of the package: its size, and whether its sha256 matches the checksum list (None
    for the checksum list and the signature, which it does not cover)."""

    name: str
    size: int
    checksum_ok: bool | None


@dataclass(frozen=True)
class PackageInfo:
    """A report on a package. `key_id` is the key `signature.json` names, not verified;
    `checksum_problems` lists what does not hold (empty when `checksums_ok`); `vram_mb` is the
    memory the tensors take in `dtype`, in MiB (numel × bytes per element / 2^20)."""

    manifest: Manifest
    size: int
    content_hash: str
    key_id: str | None
    files: tuple[FileInfo, ...]
    checksums_ok: bool
    checksum_problems: tuple[str, ...]
    tensors: tuple[TensorInfo, ...]
    num_parameters: int
    dtype: str
    vram_mb: float

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict."""
        return {
            "manifest": self.manifest.to_dict(),
            "size": self.size,
            "content_hash": self.content_hash,
            "key_id": self.key_id,
            "key_verified": False,
            "files": [{"name": f.name, "size": f.size, "checksum_ok": f.checksum_ok} for f in self.files],
            "checksums_ok": self.checksums_ok,
            "checksum_problems": list(self.checksum_problems),
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors],
            "num_parameters": self.num_parameters,
            "dtype": self.dtype,
            "vram_mb": self.vram_mb,
        }


def inspect_package(
    source: bytes | str | PathLike[str], *, dtype: str = "float32", max_bytes: int = DEFAULT_MAX_BYTES
) -> PackageInfo:
    """Report on the package `source` (bytes or a path) without verifying its signature: manifest,
    file sizes, whether the checksums hold, the claimed signing key, the tensors (name, shape,
    stored dtype), the parameter count and `vram_mb` in `dtype` (float32, bfloat16 or float16).
    A malformed container, an invalid manifest or an unreadable safetensors header is a
    `PackageError`; a bad `dtype` is a ValueError."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    data = load_source(source, max_bytes)
    files = load_package_files(data, max_bytes=max_bytes)
    manifest = parse_manifest(files[MANIFEST_FILE])
    tensors = parse_tensors(files[WEIGHTS_FILE])
    ok, problems = _check_checksums(files)
    try:
        key_id: str | None = parse_signature(files[SIGNATURE_FILE]).key_id
    except PackageError:
        key_id = None
    num_parameters = sum(t.numel for t in tensors)
    return PackageInfo(
        manifest=manifest,
        size=len(data),
        content_hash=sha256_hex(files[CHECKSUMS_FILE]),
        key_id=key_id,
        files=tuple(FileInfo(name, len(files[name]), ok.get(name)) for name in PACKAGE_FILES),
        checksums_ok=not problems,
        checksum_problems=problems,
        tensors=tensors,
        num_parameters=num_parameters,
        dtype=dtype,
        vram_mb=num_parameters * DTYPE_BYTES[dtype] / 2**20,
    )


def _check_checksums(files: dict[str, bytes]) -> tuple[dict[str, bool], tuple[str, ...]]:
    try:
        listed = parse_checksums(files[CHECKSUMS_FILE])
    except PackageError as exc:
        return {}, (str(exc),)
    ok = {name: sha256_hex(files[name]) == listed[name] for name in PAYLOAD_FILES}
    return ok, tuple(f"{name}: checksum mismatch" for name in PAYLOAD_FILES if not ok[name])
