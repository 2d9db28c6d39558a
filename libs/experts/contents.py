"""The unverified contents of a `.expert` package, and the rules that tie its files together.

Shared by `package.py` (which verifies the signature and checksums before trusting any of this)
and `inspection.py` (which reports on a package without a keyring).
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from libs.experts.archive import TAR_OVERHEAD, read_tar_gz
from libs.experts.errors import ManifestError, PackageError
from libs.experts.integrity import CHECKSUMS_FILE, CONFIG_FILE, MANIFEST_FILE, SIGNATURE_FILE, WEIGHTS_FILE
from libs.experts.jsonio import loads_strict
from libs.experts.manifest import Manifest
from libs.experts.peft_adapter import check_tensors, parse_adapter_config, parse_tensors
from libs.experts.safetensors_header import TensorInfo

# The order of the files in the tar.
PACKAGE_FILES = (MANIFEST_FILE, CONFIG_FILE, WEIGHTS_FILE, CHECKSUMS_FILE, SIGNATURE_FILE)
DEFAULT_MAX_BYTES = 2 << 30
# Everything but the weights is a small text file; bounding them bounds a hostile package's memory.
SMALL_FILE_LIMIT = 1 << 20
# Config keys that must agree with the manifest field of the same meaning: (PEFT key, manifest field).
_AGREEING_FIELDS = (
    ("target_modules", "target_modules"),
    ("r", "rank"),
    ("lora_alpha", "alpha"),
    ("use_rslora", "use_rslora"),
    ("num_virtual_tokens", "num_virtual_tokens"),
    ("feedforward_modules", "feedforward_modules"),
)


def load_source(source: bytes | str | PathLike[str], max_bytes: int) -> bytes:
    """The package bytes of `source` (bytes, or a path to read), refusing a missing file or one
    larger than `max_bytes` (plus the container's overhead) before reading it."""
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    else:
        path = Path(source)
        try:
            if path.stat().st_size > max_bytes + TAR_OVERHEAD:
                raise PackageError(f"{path}: larger than the limit of {max_bytes} bytes")
            data = path.read_bytes()
        except FileNotFoundError:
            raise PackageError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise PackageError(f"{path}: is a directory, not a package") from None
        except OSError as exc:
            raise PackageError(f"{path}: cannot read ({exc.strerror})") from None
    if len(data) > max_bytes + TAR_OVERHEAD:
        raise PackageError(f"the package is larger than the limit of {max_bytes} bytes")
    return data


def load_package_files(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, bytes]:
    """The five files of the package bytes `data`, unverified; refuses a malformed container, an
    unexpected or oversized file, or a missing one."""
    limits = {name: SMALL_FILE_LIMIT for name in PACKAGE_FILES} | {WEIGHTS_FILE: max_bytes}
    files = read_tar_gz(data, limits, max_total=max_bytes)
    for name in PACKAGE_FILES:
        if name not in files:
            raise PackageError(f"missing file {name!r}")
    return files


def parse_manifest(data: bytes) -> Manifest:
    """The manifest of `manifest.json` bytes; refusals are prefixed with the file name."""
    try:
        return Manifest.from_json_bytes(data)
    except ManifestError as exc:
        raise PackageError(f"{MANIFEST_FILE}: {exc}") from None


def parse_json_file(name: str, data: bytes) -> Any:
    """The strict JSON of the package file `name`; refusals are prefixed with the file name."""
    try:
        return loads_strict(data)
    except ValueError as exc:
        raise PackageError(f"{name}: {exc}") from None


def check_payload(manifest: Manifest, adapter_config: Any, weights: bytes) -> tuple[TensorInfo, ...]:
    """Check that the PEFT config is one the engine applies and agrees with the manifest, and that
    the safetensors header parses and holds the tensors both promise; returns those tensors."""
    settings = parse_adapter_config(adapter_config)
    if settings.adapter_type != manifest.adapter_type:
        raise PackageError(
            f"{CONFIG_FILE}: peft_type {adapter_config['peft_type']!r} does not match the manifest's "
            f"adapter_type {manifest.adapter_type!r}"
        )
    for peft_key, field in _AGREEING_FIELDS:
        theirs, mine = getattr(settings, field), getattr(manifest, field)
        if isinstance(mine, tuple):
            mine = tuple(sorted(mine))
        if theirs != mine:
            raise PackageError(
                f"{CONFIG_FILE}: {peft_key} {theirs!r} does not match the manifest's {field} {mine!r}"
            )
    tensors = parse_tensors(weights)
    check_tensors(settings, tensors, manifest.base_model)
    return tensors
