"""The expert store: installed `.expert` packages on disk, content-addressed, by name and version.

    <root>/blobs/<content_hash>.expert     the package bytes exactly as installed
    <root>/index/<name>/<version>.json     what is installed under that name and version

A package is stored under its content hash (the sha256 of its checksum list, so of its whole
payload), which lets two versions of an expert, or two experts with the same weights, coexist
without copies. Installing verifies the package against the trusted keyring and the base model it
must fit, first; a name and version already installed with other content is refused (publish a
new version instead), the same content again is a no-op. Index entries are created with O_EXCL and
blobs are written to a temporary file and renamed, so concurrent installers never see half an
entry or half a package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.experts.errors import PackageError
from libs.experts.inspection import inspect_package
from libs.experts.manifest import BaseModelIdentity, Manifest
from libs.experts.package import VerifiedPackage, read_package, write_package
from libs.experts.safetensors_header import read_header
from libs.experts.signing import Keyring

_HASH = re.compile(r"[0-9a-f]{64}")
_INDEX_FORMAT = 1


class StoreError(ValueError):
    """An install or lookup the store refuses; the message names what is wrong."""


class ExpertNotInstalledError(StoreError):
    """No expert (or no such version of it) is installed."""


@dataclass(frozen=True)
class StoredExpert:
    """One installed version of an expert."""

    manifest: Manifest
    content_hash: str
    size: int  # bytes of the package
    weight_bytes: int  # bytes of its adapter weights (safetensors)
    weight_elements: int  # numbers in its adapter tensors (an engine holds them as float32)
    key_id: str
    installed_at: float

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _INDEX_FORMAT,
            "manifest": self.manifest.to_dict(),
            "content_hash": self.content_hash,
            "size": self.size,
            "weight_bytes": self.weight_bytes,
            "weight_elements": self.weight_elements,
            "key_id": self.key_id,
            "installed_at": self.installed_at,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StoredExpert:
        if raw.get("format") != _INDEX_FORMAT:
            raise StoreError(f"index entry format {raw.get('format')!r} is not {_INDEX_FORMAT}")
        return cls(
            manifest=Manifest.from_dict(raw["manifest"]),
            content_hash=raw["content_hash"],
            size=int(raw["size"]),
            weight_bytes=int(raw["weight_bytes"]),
            weight_elements=int(raw["weight_elements"]),
            key_id=raw["key_id"],
            installed_at=float(raw["installed_at"]),
        )


def version_key(version: str) -> tuple:
    """A sort key giving SemVer 2.0 precedence: numeric core, a pre-release below its release,
    pre-release identifiers compared numerically or lexically (numeric ones first), build metadata
    ignored."""
    core, _, prerelease = version.split("+", 1)[0].partition("-")
    numbers = tuple(int(part) for part in core.split("."))
    if not prerelease:
        return (numbers, 1, ())
    identifiers = tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part) for part in prerelease.split(".")
    )
    return (numbers, 0, identifiers)


class ExpertStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.index = self.root / "index"

    # -- installing -------------------------------------------------------------------------------

    def install(
        self, source: bytes | str | os.PathLike[str], keyring: Keyring, base_model: BaseModelIdentity
    ) -> tuple[StoredExpert, bool]:
        """Verify a package and install it; returns the entry and whether it was new. Raises
        PackageError for a package that does not verify, StoreError for one for another base
        model or a name and version already installed with other content."""
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        package = read_package(data, keyring)
        mismatch = package.manifest.base_model.mismatch(base_model)
        if mismatch is not None:
            raise StoreError(
                f"{package.manifest.name}@{package.manifest.version} is for another base model "
                f"(base_model.{mismatch})"
            )
        existing = self._find(package.manifest.name, package.manifest.version)
        if existing is not None:
            return self._same_or_refuse(existing, package), False
        self._write_blob(package.content_hash, data)
        entry = StoredExpert(
            package.manifest,
            package.content_hash,
            len(data),
            len(package.weights),
            sum(t.numel for t in read_header(package.weights)),
            package.key_id,
            time.time(),
        )
        path = self._entry_path(entry.name, entry.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another installer won the race: same rules as above
            return self._same_or_refuse(self._load(path), package), False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry.to_dict(), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        return entry, True

    def _same_or_refuse(self, existing: StoredExpert, package: VerifiedPackage) -> StoredExpert:
        if existing.content_hash == package.content_hash:
            return existing
        raise StoreError(
            f"{existing.name}@{existing.version} is already installed with other content "
            f"(installed {existing.content_hash[:12]}…, this package {package.content_hash[:12]}…); "
            "publish the change as a new version"
        )

    def _write_blob(self, content_hash: str, data: bytes) -> None:
        path = self.blob_path(content_hash)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_package(path, data)

    # -- reading ------------------------------------------------------------------------------------

    def get(self, name: str, version: str | None = None) -> StoredExpert:
        """That version of `name`, or its highest version (SemVer precedence) when none is given."""
        if version is not None:
            entry = self._find(name, version)
            if entry is None:
                raise ExpertNotInstalledError(f"{name}@{version} is not installed")
            return entry
        versions = self.versions(name)
        if not versions:
            raise ExpertNotInstalledError(f"expert {name!r} is not installed")
        return versions[-1]

    def versions(self, name: str) -> list[StoredExpert]:
        """Every installed version of `name`, lowest first."""
        folder = self.index / name
        if not _is_safe_name(name) or not folder.is_dir():
            return []
        entries = [self._load(path) for path in folder.glob("*.json")]
        return sorted(entries, key=lambda e: version_key(e.version))

    def list(self) -> list[StoredExpert]:
        """Every installed version of every expert, by name, then version."""
        if not self.index.is_dir():
            return []
        return [entry for folder in sorted(self.index.iterdir()) for entry in self.versions(folder.name)]

    def read(self, entry: StoredExpert) -> bytes:
        """The package bytes of an entry (verify them again with read_package before use)."""
        try:
            return self.blob_path(entry.content_hash).read_bytes()
        except FileNotFoundError:
            raise StoreError(
                f"the package of {entry.name}@{entry.version} ({entry.content_hash[:12]}…) is missing "
                "from the store; install it again"
            ) from None

    def blob_path(self, content_hash: str) -> Path:
        if not _HASH.fullmatch(content_hash):
            raise StoreError(f"{content_hash!r} is not a content hash (64 lowercase hex digits)")
        return self.blobs / f"{content_hash}.expert"

    # -- removing -----------------------------------------------------------------------------------

    def remove(self, name: str, version: str | None = None) -> list[StoredExpert]:
        """Uninstall that version of `name`, or every version; returns what was removed. A package
        blob goes once no entry refers to it any more."""
        removed = [self.get(name, version)] if version is not None else self.versions(name)
        if not removed:
            raise ExpertNotInstalledError(f"expert {name!r} is not installed")
        for entry in removed:
            self._entry_path(entry.name, entry.version).unlink(missing_ok=True)
        folder = self.index / name
        if folder.is_dir() and not any(folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
        still_used = {entry.content_hash for entry in self.list()}
        for content_hash in {entry.content_hash for entry in removed} - still_used:
            self.blob_path(content_hash).unlink(missing_ok=True)
        return removed

    # -- internals ----------------------------------------------------------------------------------

    def _entry_path(self, name: str, version: str) -> Path:
        if not _is_safe_name(name) or not _is_safe_name(version):
            raise StoreError(f"{name!r}@{version!r} is not a valid expert name and version")
        return self.index / name / f"{version}.json"

    def _find(self, name: str, version: str) -> StoredExpert | None:
        path = self._entry_path(name, version)
        return self._load(path) if path.exists() else None

    def _load(self, path: Path) -> StoredExpert:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(raw, dict) and "weight_elements" not in raw:
                # An entry of the store's first format: count the numbers from its package.
                raw["weight_elements"] = inspect_package(self.blob_path(raw["content_hash"])).num_parameters
            return StoredExpert.from_dict(raw)
        except (OSError, ValueError, KeyError, TypeError, PackageError) as exc:
            raise StoreError(f"the store's index entry {path} is unreadable ({exc})") from None


def _is_safe_name(text: str) -> bool:
    """A manifest's name or SemVer version: never a path separator, never '.' or '..'."""
    return bool(text) and "/" not in text and "\\" not in text and text not in (".", "..")


__all__ = [
    "ExpertNotInstalledError",
    "ExpertStore",
    "PackageError",
    "StoreError",
    "StoredExpert",
    "version_key",
]
