"""The errors that refusals of manifests, packages and PEFT adapters raise.

They live in one leaf module because several modules raise them and import each other;
`libs.experts.manifest.ManifestError` and `libs.experts.package.PackageError` are these classes.
"""

from __future__ import annotations


class ManifestError(ValueError):
    """An invalid manifest (or base-model identity) field; `field` names it (`manifest.name`) and the
    message starts with it: `manifest.name: '../x' does not match [a-z0-9][a-z0-9-]{1,63}`."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class PackageError(ValueError):
    """A package (or the adapter it is built from) was refused; the message starts with the file or
    field at fault, e.g. `adapter_model.safetensors: checksum mismatch`."""
