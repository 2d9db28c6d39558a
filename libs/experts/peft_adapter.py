"""Adapters as `peft` saves them, and the subset of PEFT the engine applies.

`read_peft_adapter` reads a directory written by `PeftModel.save_pretrained` (`adapter_config.json`
and `adapter_model.safetensors`). `parse_adapter_config` and `check_tensors` hold the rules, and a
package reader applies them again, because the engine implements plain LoRA (optionally rsLoRA),
IA³ and prompt tuning only: a DoRA, a bias-training LoRA or a regex-targeted adapter is refused by
name rather than applied wrongly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from libs.experts.base_model import BaseModelIdentity
from libs.experts.errors import PackageError
from libs.experts.jsonio import loads_strict
from libs.experts.safetensors_header import TensorInfo, read_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_TYPES = {"LORA": "lora", "IA3": "ia3", "PROMPT_TUNING": "soft_prompt"}
_TASK_TYPES = (None, "CAUSAL_LM")
# LoRA options that change what the adapter computes; the engine implements none of them.
_LORA_VARIANTS = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "layers_to_transform",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
)
_IA3_VARIANTS = ("fan_in_fan_out", "modules_to_save")
_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LORA_KEY_RE = re.compile(
    r"(?P<prefix>(?:.*\.)?(?P<module>[A-Za-z_][A-Za-z0-9_]*))\.lora_(?P<ab>[AB])\.weight"
)
_IA3_KEY_RE = re.compile(r"(?:.*\.)?(?P<module>[A-Za-z_][A-Za-z0-9_]*)\.ia3_l")
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class AdapterSettings:
    """What a PEFT config says about the adapter, in the manifest's terms."""

    adapter_type: str
    target_modules: tuple[str, ...] = ()
    rank: int | None = None
    alpha: float | None = None
    use_rslora: bool = False
    num_virtual_tokens: int | None = None
    feedforward_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter read from disk: its settings in the manifest's terms (target modules sorted),
    the raw `config` dict and `weights`, the bytes of its safetensors file."""

    adapter_type: str
    config: dict[str, Any]
    weights: bytes
    target_modules: tuple[str, ...]
    rank: int | None
    alpha: float | None
    use_rslora: bool
    num_virtual_tokens: int | None
    feedforward_modules: tuple[str, ...]

    @property
    def settings(self) -> AdapterSettings:
        return AdapterSettings(
            self.adapter_type,
            self.target_modules,
            self.rank,
            self.alpha,
            self.use_rslora,
            self.num_virtual_tokens,
            self.feedforward_modules,
        )


def read_peft_adapter(path: str | PathLike[str]) -> PeftAdapter:
    """Read the PEFT adapter directory `path` (LoRA, IA³ or prompt tuning); every refusal is a
    `PackageError` naming the file or config field."""
    directory = Path(path)
    if not directory.is_dir():
        raise PackageError(f"{directory}: not a PEFT adapter directory")
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file():
        raise PackageError(f"{CONFIG_FILE}: missing in {directory}")
    if not weights_path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise PackageError(
                f"{WEIGHTS_FILE}: missing in {directory}; adapter_model.bin is a pickle, which is not "
                "accepted: save the adapter with safe_serialization=True"
            )
        raise PackageError(f"{WEIGHTS_FILE}: missing in {directory}")
    try:
        config = loads_strict(config_path.read_bytes())
    except ValueError as exc:
        raise PackageError(f"{CONFIG_FILE}: {exc}") from None
    settings = parse_adapter_config(config)
    weights = weights_path.read_bytes()
    check_tensors(settings, parse_tensors(weights))
    return PeftAdapter(**vars(settings), config=config, weights=weights)


def parse_adapter_config(config: Any) -> AdapterSettings:
    """The settings of a PEFT `adapter_config.json` dict, refusing what the engine cannot apply
    with a `PackageError` naming the field, such as `adapter_config.json: use_dora: True is not
    supported (the engine applies plain adapters)`."""
    if not isinstance(config, dict):
        raise PackageError(f"{CONFIG_FILE}: must be a JSON object")
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type not in PEFT_TYPES:
        raise PackageError(
            f"{CONFIG_FILE}: peft_type: {peft_type!r} is not supported (only {', '.join(PEFT_TYPES)})"
        )
    if config.get("task_type") not in _TASK_TYPES:
        raise PackageError(
            f"{CONFIG_FILE}: task_type: {config['task_type']!r} is not supported (only CAUSAL_LM)"
        )
    return _SETTINGS_BY_TYPE[peft_type](config)


def _lora_settings(config: dict[str, Any]) -> AdapterSettings:
    _refuse_variants(config, _LORA_VARIANTS)
    if config.get("bias", "none") != "none":
        raise _config_error("bias", f"{config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not _is_int(rank) or rank < 1:
        raise _config_error("r", f"{rank!r} is not an integer >= 1")
    if not _is_real(alpha) or not math.isfinite(alpha) or alpha <= 0:
        raise _config_error("lora_alpha", f"{alpha!r} is not a number > 0")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _config_error("use_rslora", f"{use_rslora!r} is not a boolean")
    return AdapterSettings("lora", _modules(config, "target_modules"), rank, float(alpha), use_rslora)


def _ia3_settings(config: dict[str, Any]) -> AdapterSettings:
    _refuse_variants(config, _IA3_VARIANTS)
    targets = _modules(config, "target_modules")
    feedforward = _modules(config, "feedforward_modules", required=False)
    if not set(feedforward) <= set(targets):
        raise _config_error("feedforward_modules", "must be a subset of target_modules")
    return AdapterSettings("ia3", targets, feedforward_modules=feedforward)


def _prompt_tuning_settings(config: dict[str, Any]) -> AdapterSettings:
    _refuse_variants(config, ("modules_to_save",))
    tokens, submodules = config.get("num_virtual_tokens"), config.get("num_transformer_submodules", 1)
    if not _is_int(tokens) or tokens < 1:
        raise _config_error("num_virtual_tokens", f"{tokens!r} is not an integer >= 1")
    # Encoder-decoder models get one prompt per submodule; a decoder-only model has one.
    if submodules != 1:
        raise _config_error("num_transformer_submodules", f"{submodules!r} is not supported (only 1)")
    return AdapterSettings("soft_prompt", num_virtual_tokens=tokens)


_SETTINGS_BY_TYPE = {"LORA": _lora_settings, "IA3": _ia3_settings, "PROMPT_TUNING": _prompt_tuning_settings}


def parse_tensors(weights: bytes) -> tuple[TensorInfo, ...]:
    """The tensors in the safetensors bytes `weights`, or a `PackageError` saying why not."""
    try:
        return read_header(weights)
    except ValueError as exc:
        raise PackageError(f"{WEIGHTS_FILE}: invalid safetensors header: {exc}") from None


def check_tensors(
    settings: AdapterSettings, tensors: tuple[TensorInfo, ...], base_model: BaseModelIdentity | None = None
) -> None:
    """Check that `tensors` are what the settings promise, with PEFT's key names: LoRA A/B pairs of
    the given rank on target modules, IA³ vectors shaped as PEFT shapes them, one prompt embedding
    of `num_virtual_tokens` rows; and, given `base_model`, layer indices and the soft prompt's width
    within it. Raises a `PackageError` naming the tensor."""
    if not tensors:
        raise PackageError(f"{WEIGHTS_FILE}: contains no tensors")
    for t in tensors:
        if t.dtype not in _FLOAT_DTYPES:
            raise _tensor_error(t, f"dtype {t.dtype} is not a floating-point type")
        layer = _LAYER_RE.search(t.name)
        if base_model is not None and layer and int(layer.group(1)) >= base_model.num_layers:
            raise _tensor_error(t, f"layer {layer.group(1)} but the base model has {base_model.num_layers}")
    if settings.adapter_type == "lora":
        _check_lora(settings, tensors)
    elif settings.adapter_type == "ia3":
        _check_ia3(settings, tensors)
    else:
        if [t.name for t in tensors] != ["prompt_embeddings"]:
            raise PackageError(f"{WEIGHTS_FILE}: a soft prompt holds exactly one tensor, 'prompt_embeddings'")
        (t,) = tensors
        width = base_model.hidden_size if base_model is not None else None
        if len(t.shape) != 2 or t.shape[0] != settings.num_virtual_tokens or width not in (None, t.shape[1]):
            expected = f"[{settings.num_virtual_tokens}, {width or 'hidden_size'}]"
            raise _tensor_error(t, f"shape {list(t.shape)}, expected {expected}")


def _check_lora(settings: AdapterSettings, tensors: tuple[TensorInfo, ...]) -> None:
    halves: dict[str, set[str]] = {}
    for t in tensors:
        match = _LORA_KEY_RE.fullmatch(t.name)
        if match is None:
            raise _tensor_error(
                t, "not a LoRA weight (expected '<module>.lora_A.weight' or '.lora_B.weight')"
            )
        _check_module(t, match["module"], settings.target_modules)
        # lora_A: [rank, in_features]; lora_B: [out_features, rank].
        rank_dim = 0 if match["ab"] == "A" else 1
        if len(t.shape) != 2 or t.shape[rank_dim] != settings.rank:
            raise _tensor_error(
                t, f"shape {list(t.shape)} does not have rank {settings.rank} in dimension {rank_dim}"
            )
        halves.setdefault(match["prefix"], set()).add(match["ab"])
    for prefix, found in sorted(halves.items()):
        if found != {"A", "B"}:
            missing = "B" if "A" in found else "A"
            raise PackageError(f"{WEIGHTS_FILE}: {prefix}.lora_{missing}.weight is missing")


def _check_ia3(settings: AdapterSettings, tensors: tuple[TensorInfo, ...]) -> None:
    for t in tensors:
        match = _IA3_KEY_RE.fullmatch(t.name)
        if match is None:
            raise _tensor_error(t, "not an IA3 vector (expected '<module>.ia3_l')")
        _check_module(t, match["module"], settings.target_modules)
        # PEFT scales a feed-forward module's input ([1, in]) and any other module's output ([out, 1]).
        feedforward = match["module"] in settings.feedforward_modules
        if len(t.shape) != 2 or t.shape[0 if feedforward else 1] != 1:
            expected = "[1, in_features]" if feedforward else "[out_features, 1]"
            raise _tensor_error(t, f"shape {list(t.shape)}, expected {expected}")


def _check_module(t: TensorInfo, module: str, targets: tuple[str, ...]) -> None:
    if module not in targets:
        raise _tensor_error(t, f"module {module!r} is not in target_modules")


def _modules(config: dict[str, Any], key: str, *, required: bool = True) -> tuple[str, ...]:
    value = config.get(key)
    if value is None and not required:
        return ()
    if isinstance(value, str):
        raise _config_error(key, f"a pattern ({value!r}) is not supported; list the module names")
    if not isinstance(value, list) or (required and not value):
        raise _config_error(key, f"{value!r} is not a non-empty list of module names")
    for name in value:
        if not isinstance(name, str) or not _IDENTIFIER_RE.fullmatch(name):
            raise _config_error(key, f"{name!r} is not a plain module name")
    if len(set(value)) != len(value):
        raise _config_error(key, "lists a module twice")
    return tuple(sorted(value))


def _refuse_variants(config: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = config.get(key)
        if value:
            raise _config_error(key, f"{value!r} is not supported (the engine applies plain adapters)")


def _config_error(key: str, problem: str) -> PackageError:
    return PackageError(f"{CONFIG_FILE}: {key}: {problem}")


def _tensor_error(t: TensorInfo, problem: str) -> PackageError:
    return PackageError(f"{WEIGHTS_FILE}: tensor {t.name!r}: {problem}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
