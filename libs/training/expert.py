"""One expert from its samples: the adapter trained and, with a `PackageSpec`, packed and signed.

`expertctl expert train` and the demo set's builder (`make experts`) both train through
`train_expert`, after checking everything that can be checked before the model loads (settings,
paths, the package's metadata against the base model, the data)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from libs.experts.errors import ManifestError, PackageError
from libs.experts.package import write_package
from libs.experts.packing import pack_adapter
from libs.training.run import PreparedRun

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from libs.experts.packing import ExpertMetadata


class PackError(Exception):
    """The adapter was trained and written, but cannot be packed; the message says both."""


@dataclass(frozen=True)
class PackageSpec:
    """The package to write beside the adapter: its metadata (the examples come from the data), the
    key that signs it, its path, and how many training prompts the manifest lists."""

    metadata: ExpertMetadata
    key: Ed25519PrivateKey
    path: Path
    examples: int = 32


def train_expert(
    prepared: PreparedRun, out: Path, package: PackageSpec | None = None, progress=None, control=None
) -> dict:
    """Train into `out` (replaced only once training finished), then write the package if asked for.
    Returns the summary: `{"adapter": ..., "package": ...}` (`package` only when one was written).
    `control` (libs.training.control) may resume the run, checkpoint it and stop it."""
    report = prepared.train(out, progress, control)
    summary = {"adapter": report.to_dict()}
    if package is None:
        return summary
    metadata = package.metadata.with_examples(prepared.example_prompts(package.examples))
    try:
        data, packed = pack_adapter(out, prepared.base_dir, metadata, package.key)
    except (PackageError, ManifestError) as exc:
        raise PackError(f"the adapter was written to {out} but cannot be packed: {exc}") from None
    package.path.parent.mkdir(parents=True, exist_ok=True)
    write_package(package.path, data)
    summary["package"] = {
        "path": str(package.path),
        "name": packed.manifest.name,
        "version": packed.manifest.version,
        "content_hash": packed.content_hash,
        "size": packed.size,
        "examples": len(packed.manifest.examples),
    }
    return summary
