"""A signed package from a PEFT adapter directory: the manifest's adapter fields come from the
adapter, the rest from the publisher. `expertctl expert pack` and `expertctl expert train` both use it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from os import PathLike
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from libs.experts.manifest import BaseModelIdentity, Manifest
from libs.experts.package import VerifiedPackage, build_package, read_package
from libs.experts.peft_adapter import AdapterSettings, read_peft_adapter
from libs.experts.signing import Keyring


@dataclass(frozen=True)
class ExpertMetadata:
    """What a publisher says of an expert (everything in the manifest that the adapter does not fix)."""

    name: str
    version: str
    description: str
    keywords: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    task_types: tuple[str, ...] = ()
    priority: int = 0
    incompatible_with: tuple[str, ...] = ()
    author: str = ""

    def with_examples(self, examples: tuple[str, ...]) -> ExpertMetadata:
        return replace(self, examples=examples)


def check_metadata(metadata: ExpertMetadata, base_dir: Path) -> None:
    """Raise the ManifestError a package with this metadata would raise, before any adapter exists
    (checked on a stand-in soft prompt: the metadata's rules do not depend on the adapter)."""
    _manifest(metadata, base_dir, AdapterSettings("soft_prompt", num_virtual_tokens=1))


def pack_adapter(
    peft_dir: str | PathLike[str], base_dir: Path, metadata: ExpertMetadata, private_key: Ed25519PrivateKey
) -> tuple[bytes, VerifiedPackage]:
    """The package's bytes, and the package as a server reads it back (a package that cannot be read
    must not be written). Raises PackageError, ManifestError or SigningError naming the problem."""
    adapter = read_peft_adapter(peft_dir)
    manifest = _manifest(metadata, base_dir, adapter.settings)
    data = build_package(manifest, adapter.config, adapter.weights, private_key)
    return data, read_package(data, Keyring.of(private_key.public_key()))


def _manifest(metadata: ExpertMetadata, base_dir: Path, adapter: AdapterSettings) -> Manifest:
    return Manifest(
        name=metadata.name,
        version=metadata.version,
        description=metadata.description,
        adapter_type=adapter.adapter_type,
        base_model=BaseModelIdentity.from_dir(base_dir),
        target_modules=adapter.target_modules,
        rank=adapter.rank,
        alpha=adapter.alpha,
        use_rslora=adapter.use_rslora,
        num_virtual_tokens=adapter.num_virtual_tokens,
        feedforward_modules=adapter.feedforward_modules,
        capabilities=metadata.capabilities,
        keywords=metadata.keywords,
        examples=metadata.examples,
        task_types=metadata.task_types,
        priority=metadata.priority,
        incompatible_with=metadata.incompatible_with,
        author=metadata.author,
    )
