"""An expert's manifest: what it is, what it fits, and what the router needs to pick it.

`Manifest` validates itself on construction, so a `Manifest` object is always a valid one; every
refusal is a `ManifestError` naming the field (`manifest.rank: ...`). `to_json_bytes` is canonical
(the package signs its bytes) and `from_json_bytes` refuses unknown keys, so a manifest written by a
newer format is never half-understood.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from libs.experts.base_model import BaseModelIdentity
from libs.experts.errors import ManifestError
from libs.experts.jsonio import dumps_canonical, loads_strict

__all__ = ["ADAPTER_TYPES", "BaseModelIdentity", "Manifest", "ManifestError"]

ADAPTER_TYPES = ("lora", "ia3", "soft_prompt")
FORMAT_VERSION = 1
NAME_PATTERN = "[a-z0-9][a-z0-9-]{1,63}"
_NAME_RE = re.compile(NAME_PATTERN)
# SemVer 2.0's own regular expression (semver.org), anchored by fullmatch.
_SEMVER_RE = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_DESCRIPTION = 2000
# The store names a file by the version (index/<name>/<version>.json, libs/experts/store.py) and the
# trainer a package (<name>-<version>.expert): file names are at most 255 bytes.
MAX_VERSION = 128
MAX_PRIORITY = 1000
MAX_AUTHOR = 200
# Free-text lists: (most items, longest item). Bounded so that a manifest stays a small file.
_TEXT_LISTS = {
    "capabilities": (100, 200),
    "keywords": (100, 100),
    "examples": (50, 2000),
    "task_types": (20, 100),
}
_MAX_MODULES = 64
_TUPLE_FIELDS = (
    "target_modules",
    "feedforward_modules",
    "capabilities",
    "keywords",
    "examples",
    "task_types",
    "incompatible_with",
)
_REQUIRED_KEYS = ("name", "version", "description", "adapter_type", "base_model", "target_modules")


@dataclass(frozen=True)
class Manifest:
    """The signed description of one expert: identity (`name`, `version`), the adapter's kind and
    hyper-parameters, the base model its weights fit, and the router's metadata (capabilities,
    keywords, examples, task types, priority, incompatibilities). Lists given as Python lists are
    stored as tuples; `alpha` is stored as a float."""

    name: str
    version: str
    description: str
    adapter_type: str
    base_model: BaseModelIdentity
    target_modules: tuple[str, ...]
    rank: int | None
    alpha: float | None
    use_rslora: bool = False
    num_virtual_tokens: int | None = None
    feedforward_modules: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    task_types: tuple[str, ...] = ()
    priority: int = 0
    incompatible_with: tuple[str, ...] = ()
    author: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        self._normalize_lists()
        self._check_identity()
        self._check_adapter_fields()
        self._check_router_fields()
        if not isinstance(self.author, str) or len(self.author) > MAX_AUTHOR:
            raise ManifestError("manifest.author", f"must be a string of at most {MAX_AUTHOR} characters")

    def _normalize_lists(self) -> None:
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, list):
                # Frozen: normalizing a list to a tuple is the one write we allow ourselves.
                object.__setattr__(self, name, tuple(value))
            elif not isinstance(value, tuple):
                raise ManifestError(f"manifest.{name}", f"must be a list of strings, not {value!r}")

    def _check_identity(self) -> None:
        """The format, name, version, description, adapter type and base model."""
        if not _is_int(self.format_version) or self.format_version != FORMAT_VERSION:
            raise ManifestError(
                "manifest.format_version", f"{self.format_version!r} is not supported (only {FORMAT_VERSION})"
            )
        _check_name("manifest.name", self.name)
        _check_version("manifest.version", self.version)
        _check_text("manifest.description", self.description, MAX_DESCRIPTION)
        if self.adapter_type not in ADAPTER_TYPES:
            raise ManifestError(
                "manifest.adapter_type", f"{self.adapter_type!r} is not one of {', '.join(ADAPTER_TYPES)}"
            )
        if not isinstance(self.base_model, BaseModelIdentity):
            raise ManifestError("manifest.base_model", "must be a BaseModelIdentity")

    def _check_adapter_fields(self) -> None:
        """The adapter's modules and hyper-parameters: each adapter type has its own."""
        self._check_modules()
        self._check_lora_fields()
        kind = self.adapter_type
        if kind == "soft_prompt":
            if not _is_int(self.num_virtual_tokens) or self.num_virtual_tokens < 1:
                raise ManifestError(
                    "manifest.num_virtual_tokens",
                    f"a soft_prompt expert needs an integer >= 1, not {self.num_virtual_tokens!r}",
                )
        elif self.num_virtual_tokens is not None:
            raise ManifestError("manifest.num_virtual_tokens", f"only a soft_prompt expert has one ({kind})")
        if self.feedforward_modules and kind != "ia3":
            raise ManifestError("manifest.feedforward_modules", f"only an ia3 expert has them ({kind})")
        outside = sorted(set(self.feedforward_modules) - set(self.target_modules))
        if outside:
            raise ManifestError(
                "manifest.feedforward_modules", f"{', '.join(map(repr, outside))} not in target_modules"
            )

    def _check_modules(self) -> None:
        """Target and feedforward modules are plain names; LoRA and IA3 need targets, a soft prompt
        has none."""
        kind = self.adapter_type
        _check_strings("manifest.target_modules", self.target_modules, _MAX_MODULES, 100)
        _check_strings("manifest.feedforward_modules", self.feedforward_modules, _MAX_MODULES, 100)
        for field_name in ("target_modules", "feedforward_modules"):
            for i, module in enumerate(getattr(self, field_name)):
                if not _IDENTIFIER_RE.fullmatch(module):
                    raise ManifestError(
                        f"manifest.{field_name}[{i}]",
                        f"{module!r} is not a plain module name (an identifier)",
                    )
        if kind in ("lora", "ia3") and not self.target_modules:
            raise ManifestError("manifest.target_modules", f"a {kind} expert needs at least one")
        if kind == "soft_prompt" and self.target_modules:
            raise ManifestError("manifest.target_modules", "a soft prompt has no target modules")

    def _check_lora_fields(self) -> None:
        """`rank`, `alpha` and `use_rslora`: a LoRA expert's alone."""
        kind = self.adapter_type
        if kind == "lora":
            if not _is_int(self.rank) or self.rank < 1:
                raise ManifestError(
                    "manifest.rank", f"a lora expert needs an integer rank >= 1, not {self.rank!r}"
                )
            if not _is_real(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
                raise ManifestError(
                    "manifest.alpha", f"a lora expert needs a finite alpha > 0, not {self.alpha!r}"
                )
            object.__setattr__(self, "alpha", float(self.alpha))
        else:
            for name in ("rank", "alpha"):
                if getattr(self, name) is not None:
                    raise ManifestError(f"manifest.{name}", f"only a lora expert has one ({kind})")
        if not isinstance(self.use_rslora, bool) or (self.use_rslora and kind != "lora"):
            raise ManifestError("manifest.use_rslora", "must be a boolean, and true only for a lora expert")

    def _check_router_fields(self) -> None:
        """The router's metadata: the free-text lists, the priority, the incompatibilities."""
        for name, (max_items, max_chars) in _TEXT_LISTS.items():
            _check_strings(f"manifest.{name}", getattr(self, name), max_items, max_chars)
        if not _is_int(self.priority) or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ManifestError(
                "manifest.priority",
                f"{self.priority!r} is not an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]",
            )
        _check_strings("manifest.incompatible_with", self.incompatible_with, 100, 64)
        for i, other in enumerate(self.incompatible_with):
            _check_name(f"manifest.incompatible_with[{i}]", other)
            if other == self.name:
                raise ManifestError(f"manifest.incompatible_with[{i}]", "an expert cannot exclude itself")

    def to_dict(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict (tuples as lists, the base model as a nested dict)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, BaseModelIdentity):
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> Manifest:
        """A manifest from `to_dict`'s output (or parsed JSON): unknown keys are refused by name, JSON
        arrays become tuples, and every field is validated."""
        if not isinstance(raw, dict):
            raise ManifestError("manifest", "must be a JSON object")
        if raw.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            # Before the unknown-key check: a newer manifest should say so, not list its new keys.
            raise ManifestError(
                "manifest.format_version",
                f"{raw['format_version']!r} is not supported (only {FORMAT_VERSION})",
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ManifestError("manifest", f"unknown keys {', '.join(map(repr, unknown))}")
        for key in (*_REQUIRED_KEYS, *(("rank", "alpha") if raw.get("adapter_type") == "lora" else ())):
            if key not in raw:
                raise ManifestError(f"manifest.{key}", "missing")
        values = dict(raw)
        values.setdefault("rank", None)
        values.setdefault("alpha", None)
        for name in _TUPLE_FIELDS:
            if name in values and not isinstance(values[name], list):
                raise ManifestError(f"manifest.{name}", f"must be a list of strings, not {values[name]!r}")
        try:
            values["base_model"] = BaseModelIdentity.from_dict(values["base_model"])
        except ManifestError as exc:
            raise ManifestError(f"manifest.{exc.field}", exc.problem) from None
        return cls(**values)

    def to_json_bytes(self) -> bytes:
        """The canonical JSON of the manifest (sorted keys, indent 2, UTF-8, trailing newline)."""
        return dumps_canonical(self.to_dict())

    @classmethod
    def from_json_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate a manifest's JSON bytes; refusals are `ManifestError`s naming the field."""
        try:
            raw = loads_strict(data)
        except ValueError as exc:
            raise ManifestError("manifest", str(exc)) from None
        return cls.from_dict(raw)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_name(field: str, value: object) -> None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ManifestError(field, f"{_shown(value)} does not match {NAME_PATTERN}")


def _check_version(field: str, value: object) -> None:
    if isinstance(value, str) and len(value) > MAX_VERSION:
        raise ManifestError(field, f"is {len(value)} characters long; the limit is {MAX_VERSION}")
    if not isinstance(value, str) or not _SEMVER_RE.fullmatch(value):
        raise ManifestError(
            field, f"{_shown(value)} is not a SemVer 2.0 version (MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD])"
        )


def _shown(value: object) -> str:
    """`value` as an error shows it: its repr, a long string's cut at 64 characters."""
    if isinstance(value, str) and len(value) > 64:
        return repr(value[:64]) + "…"
    return repr(value)


def check_publisher_field(field: str, name: str, value: object) -> None:
    """Raise the ManifestError, naming `field`, that a manifest would raise for `value` as the field
    its publisher chooses called `name` ("name", "version", "description" or "keywords"): what makes
    an expert to be (a training job's) can be refused when it is asked for, not when it is packed."""
    if name == "name":
        _check_name(field, value)
    elif name == "version":
        _check_version(field, value)
    elif name == "description":
        _check_text(field, value, MAX_DESCRIPTION)
    elif name == "keywords":
        _check_strings(field, tuple(value), *_TEXT_LISTS["keywords"])
    else:
        raise ValueError(f"{name!r} is not a field a publisher chooses")


def _check_text(field: str, value: object, max_chars: int) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ManifestError(field, "must be a non-empty string")
    if len(value) > max_chars:
        raise ManifestError(field, f"is {len(value)} characters long; the limit is {max_chars}")


def _check_strings(field: str, values: tuple[Any, ...], max_items: int, max_chars: int) -> None:
    if len(values) > max_items:
        raise ManifestError(field, f"has {len(values)} entries; the limit is {max_items}")
    for i, value in enumerate(values):
        _check_text(f"{field}[{i}]", value, max_chars)
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ManifestError(field, f"{value!r} is listed twice")
        seen.add(value)
