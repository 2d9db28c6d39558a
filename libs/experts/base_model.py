"""Which base model an expert's weights fit: `BaseModelIdentity`.

An adapter's tensors are shaped by a handful of the base model's config fields; two checkpoints that
agree on them can share experts even if their weights differ (a fine-tune, a re-quantization). The
identity keeps the fields people read (architecture, sizes) and a hash of all the deciding ones.
`libs.experts.manifest` re-exports the class.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from libs.experts.errors import ManifestError

_HASH_RE = re.compile(r"[0-9a-f]{64}")
_INT_FIELDS = ("hidden_size", "num_layers", "vocab_size")
_FIELDS = ("architecture", *_INT_FIELDS, "config_hash")
_REQUIRED_CONFIG_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class BaseModelIdentity:
    """The identity of a base model as far as adapter weights are concerned: the architecture, the
    sizes a reader wants to see, and `config_hash`, the sha256 of every config field that decides
    whether adapter tensors fit (see `from_hf_config`)."""

    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    config_hash: str

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture.strip():
            raise ManifestError("base_model.architecture", "must be a non-empty string")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ManifestError(f"base_model.{name}", f"must be a positive integer, not {value!r}")
        if not isinstance(self.config_hash, str) or not _HASH_RE.fullmatch(self.config_hash):
            raise ManifestError("base_model.config_hash", "must be 64 lowercase hex digits (a sha256)")

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> BaseModelIdentity:
        """The identity of an HF `config.json` dict. `config_hash` covers architecture, vocab_size,
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        head_dim and tie_word_embeddings, with HF's defaults filled in, as canonical JSON."""
        if not isinstance(raw, dict):
            raise ManifestError("config", "must be a JSON object")
        architectures = raw.get("architectures")
        if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
            raise ManifestError("config.architectures", "must be a non-empty list of class names")
        sizes = {name: _config_int(raw, name) for name in _REQUIRED_CONFIG_INTS}
        heads = sizes["num_attention_heads"]
        kv_heads = (
            heads if raw.get("num_key_value_heads") is None else _config_int(raw, "num_key_value_heads")
        )
        head_dim = (
            sizes["hidden_size"] // heads if raw.get("head_dim") is None else _config_int(raw, "head_dim")
        )
        # HF's default when the key is absent or null.
        tie = False if raw.get("tie_word_embeddings") is None else raw["tie_word_embeddings"]
        if not isinstance(tie, bool):
            raise ManifestError("config.tie_word_embeddings", f"must be true or false, not {tie!r}")
        deciding = {
            "architecture": architectures[0],
            **sizes,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "tie_word_embeddings": tie,
        }
        canonical = json.dumps(deciding, sort_keys=True, separators=(",", ":"))
        return cls(
            architecture=architectures[0],
            hidden_size=sizes["hidden_size"],
            num_layers=sizes["num_hidden_layers"],
            vocab_size=sizes["vocab_size"],
            config_hash=hashlib.sha256(canonical.encode()).hexdigest(),
        )

    @classmethod
    def from_dir(cls, path: str | PathLike[str]) -> BaseModelIdentity:
        """The identity of the checkpoint directory `path` (its `config.json`)."""
        config_path = Path(path) / "config.json"
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ManifestError("config", f"{config_path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise ManifestError("config", f"{config_path} is not readable JSON ({exc})") from None
        return cls.from_hf_config(raw)

    def mismatch(self, other: BaseModelIdentity) -> str | None:
        """The first field where `other` differs, as `vocab_size: package 32000, model 49152` (self is
        the package's identity, `other` the model's); None when they are the same."""
        for name in _FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                if name == "config_hash":
                    return (
                        f"config_hash: package {mine[:16]}…, model {theirs[:16]}… (the models differ in "
                        "intermediate_size, attention heads, head_dim or tied embeddings)"
                    )
                return f"{name}: package {mine}, model {theirs}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The identity as a JSON-ready dict."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BaseModelIdentity:
        """The identity from `to_dict`'s output; unknown or missing keys are refused by name."""
        if not isinstance(raw, dict):
            raise ManifestError("base_model", "must be a JSON object")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise ManifestError("base_model", f"unknown keys {', '.join(map(repr, unknown))}")
        for name in _FIELDS:
            if name not in raw:
                raise ManifestError(f"base_model.{name}", "missing")
        return cls(**raw)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if not _is_int(value) or value < 1:
        raise ManifestError(f"config.{name}", f"must be a positive integer, not {value!r}")
    return value


def weights_fit(expert_hash: str, model_hash: str) -> bool:
    """Whether an expert whose manifest's base_model.config_hash is `expert_hash` may serve a model
    whose identity is `model_hash`. An unknown identity ("": a registration older than the field,
    or a plan made before any engine reported its model) fits anything."""
    return not expert_hash or not model_hash or expert_hash == model_hash
