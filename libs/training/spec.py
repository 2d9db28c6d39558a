"""What a training job asks for (`JobSpec`), read from the JSON form both APIs take, every problem
collected as (field, reason) so that the caller gets them all at once.

The form (docs/api.md#training-jobs), every field but `training_file` and `expert.name` optional:
    {"base_model", "training_file", "validation_file",
     "adapter": {"type": "lora"|"ia3"|"prompt_tuning", "rank", "alpha", "dropout",
                 "target_modules", "feedforward_modules", "num_virtual_tokens"},
     "hyperparameters": {"epochs", "max_steps", "learning_rate", "batch_size", "eval_fraction",
                         "patience", "seed", "max_sequence_length"},
     "checkpoint_every_steps", "time_budget_seconds",
     "expert": {"name", "version", "description", "keywords"}}
Every number has a ceiling (libs/training/bounds.py: those that hold everywhere are checked here, a
deployment's EXPERT_TRAINING_MAX_* by reception), so that a stored spec is JSON the gRPC messages
can always carry; the expert's name, version, description and keywords follow the package's own rules
(libs/experts/manifest.py); text that UTF-8 cannot hold is refused by its field.
A job trains an adapter on the deployment's base model. The sections of whole-model training
(`model_config`, `parallelism_config`, `memory_config`: tensor/pipeline parallelism, ZeRO, CPU and
NVMe offload) are refused by name: an adapter of a small share of the weights needs none of them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from libs.experts.errors import ManifestError
from libs.experts.manifest import check_publisher_field
from libs.training.bounds import INT32_MAX, MAX_ALPHA, MAX_LEARNING_RATE, MAX_MODULES, MAX_SEED
from libs.training.settings import ADAPTER_TYPES, TrainSettings, module_problems
from libs.utf8 import undecodable

OUT_OF_SCOPE = {
    "model_config": "training a whole model (its architecture) is out of scope",
    "parallelism_config": "tensor, pipeline, expert and context parallelism are out of scope",
    "memory_config": "ZeRO stages, CPU and NVMe offload and activation checkpointing are out of scope",
    "zero_stage": "ZeRO is out of scope",
    "cpu_offload": "CPU offload is out of scope",
    "nvme_offload": "NVMe offload is out of scope",
    "tensor_parallel_size": "tensor parallelism is out of scope",
    "pipeline_parallel_size": "pipeline parallelism is out of scope",
}
_WHY = "; a job trains an adapter (LoRA, IA3, prompt tuning) of the deployment's base model on one device"
# The API spells prompt tuning with an underscore (an identifier); the trainer with a hyphen.
API_ADAPTER_TYPES = {t.replace("-", "_"): t for t in ADAPTER_TYPES}
_TOP = {
    "base_model",
    "training_file",
    "validation_file",
    "adapter",
    "hyperparameters",
    "checkpoint_every_steps",
    "time_budget_seconds",
    "expert",
}
_ADAPTER = {"type", "rank", "alpha", "dropout", "target_modules", "feedforward_modules", "num_virtual_tokens"}
_HYPER = {
    "epochs",
    "max_steps",
    "learning_rate",
    "batch_size",
    "eval_fraction",
    "patience",
    "seed",
    "max_sequence_length",
}
_EXPERT = {"name", "version", "description", "keywords"}
MAX_KEYWORDS = 16
# A base model's name, a file's id (`file-` and 24 hex digits) or an adapter type: longer is none this
# deployment has, and would only be stored with the job to be refused later.
MAX_NAME = 256


class SpecError(ValueError):
    """A job spec with problems: `violations` lists (field, reason)."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {r}" for f, r in violations))
        self.violations = violations


@dataclass(frozen=True)
class ExpertSpec:
    name: str
    version: str = "1.0.0"
    description: str = ""
    keywords: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobSpec:
    training_file: str
    expert: ExpertSpec
    settings: TrainSettings
    base_model: str = ""  # "": the deployment's base model
    validation_file: str = ""
    checkpoint_every_steps: int = 0  # 0: the trainer's EXPERT_TRAINER_CHECKPOINT_STEPS
    time_budget_seconds: int = 0  # 0: EXPERT_TRAINING_MAX_SECONDS

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        adapter = {"type": s.adapter_type.replace("-", "_")}
        if s.adapter_type == "lora":
            adapter |= {"rank": s.rank, "alpha": s.alpha, "dropout": s.dropout}
        if s.adapter_type == "prompt-tuning":
            adapter["num_virtual_tokens"] = s.num_virtual_tokens
        if s.target_modules is not None:
            adapter["target_modules"] = list(s.target_modules)
        if s.feedforward_modules is not None:
            adapter["feedforward_modules"] = list(s.feedforward_modules)
        hyper = {
            "epochs": s.epochs,
            "max_steps": s.max_steps or 0,
            "learning_rate": s.lr,
            "batch_size": s.batch_size,
            "eval_fraction": s.eval_fraction,
            "patience": s.patience,
            "seed": s.seed,
            "max_sequence_length": s.max_length or 0,
        }
        expert = asdict(self.expert) | {"keywords": list(self.expert.keywords)}
        return {
            "base_model": self.base_model,
            "training_file": self.training_file,
            "validation_file": self.validation_file,
            "adapter": adapter,
            "hyperparameters": hyper,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "time_budget_seconds": self.time_budget_seconds,
            "expert": expert,
        }


def parse_spec(raw: Any) -> JobSpec:
    """The spec `raw` (the JSON form) describes; raises SpecError listing every problem."""
    bad_text = undecodable(raw, "")
    if bad_text is not None:  # before any message shows the text
        where, problem = bad_text
        raise SpecError([(where or "job", problem)])
    reader = _Reader()
    top = reader.section(raw, "", _TOP, required=True)
    adapter = reader.section(top.get("adapter"), "adapter.", _ADAPTER)
    hyper = reader.section(top.get("hyperparameters"), "hyperparameters.", _HYPER)
    expert_raw = reader.section(top.get("expert"), "expert.", _EXPERT, required=True)
    training_file = reader.text(top, "training_file", required=True)
    expert = _expert(reader, expert_raw)
    settings = _settings(reader, adapter, hyper)
    spec = JobSpec(
        training_file=training_file,
        expert=expert,
        settings=settings,
        base_model=reader.text(top, "base_model"),
        validation_file=reader.text(top, "validation_file"),
        checkpoint_every_steps=reader.integer(top, "checkpoint_every_steps", "", 0) or 0,
        time_budget_seconds=reader.integer(top, "time_budget_seconds", "", 0) or 0,
    )
    if reader.problems:
        raise SpecError(reader.problems)
    return spec


def _expert(reader: _Reader, raw: dict) -> ExpertSpec:
    """The expert to be, each field given checked by the rule its package's manifest will hold it to
    (an empty description is the trainer's to fill in)."""
    expert = ExpertSpec(
        name=reader.text(raw, "name", "expert.", required=True, most=None),
        version=reader.text(raw, "version", "expert.", most=None) or "1.0.0",
        description=reader.text(raw, "description", "expert.", most=None),
        keywords=reader.strings(raw, "keywords", "expert.", MAX_KEYWORDS) or (),
    )
    for name in ("name", "version", "description", "keywords"):
        value = getattr(expert, name)
        if value:
            try:
                check_publisher_field(f"expert.{name}", name, value)
            except ManifestError as error:
                reader.problem(error.field, error.problem)
    return expert


def _settings(reader: _Reader, adapter: dict, hyper: dict) -> TrainSettings:
    d = TrainSettings()
    kind = reader.text(adapter, "type", "adapter.") or "lora"
    if kind not in API_ADAPTER_TYPES:
        reader.problem("adapter.type", f"must be one of {', '.join(API_ADAPTER_TYPES)}, got {kind!r}")
        kind = "lora"
    p, h = "adapter.", "hyperparameters."
    values = {
        "adapter_type": API_ADAPTER_TYPES[kind],
        "rank": reader.integer(adapter, "rank", p, 1, d.rank),
        "alpha": reader.number(adapter, "alpha", p, d.alpha, MAX_ALPHA),
        "dropout": reader.number(adapter, "dropout", p, d.dropout, 1.0),
        "target_modules": reader.strings(adapter, "target_modules", p, MAX_MODULES),
        "feedforward_modules": reader.strings(adapter, "feedforward_modules", p, MAX_MODULES),
        "num_virtual_tokens": reader.integer(adapter, "num_virtual_tokens", p, 1, d.num_virtual_tokens),
        "epochs": reader.integer(hyper, "epochs", h, 1, d.epochs),
        "max_steps": reader.integer(hyper, "max_steps", h, 0, 0) or None,
        "learning_rate": reader.number(hyper, "learning_rate", h, 0.0, MAX_LEARNING_RATE) or None,
        "batch_size": reader.integer(hyper, "batch_size", h, 1, d.batch_size),
        "eval_fraction": reader.number(hyper, "eval_fraction", h, d.eval_fraction, 1.0),
        "patience": reader.integer(hyper, "patience", h, 1, d.patience),
        "seed": reader.integer(hyper, "seed", h, 0, d.seed, MAX_SEED),
        "max_length": reader.integer(hyper, "max_sequence_length", h, 0, 0) or None,
    }
    modules = module_problems(values["adapter_type"], values["target_modules"], values["feedforward_modules"])
    for option, problem in modules:
        reader.problem(_FIELD_OF_OPTION[option], problem)
    if modules:
        values["target_modules"] = values["feedforward_modules"] = None
    try:
        return TrainSettings(**values)
    except ValueError as exc:  # SettingsError names a command-line option: name the field instead
        option, _, reason = str(exc).partition(": ")
        reader.problem(_FIELD_OF_OPTION.get(option, option), reason)
        return d


_FIELD_OF_OPTION = {
    "--alpha": "adapter.alpha",
    "--dropout": "adapter.dropout",
    "--lr": "hyperparameters.learning_rate",
    "--eval-fraction": "hyperparameters.eval_fraction",
    "--max-length": "hyperparameters.max_sequence_length",
    "--target-modules": "adapter.target_modules",
    "--feedforward-modules": "adapter.feedforward_modules",
    "--virtual-tokens": "adapter.num_virtual_tokens",
    "--seed": "hyperparameters.seed",
}


@dataclass
class _Reader:
    """Reads fields of the JSON form, noting every problem instead of stopping at the first."""

    problems: list[tuple[str, str]] = field(default_factory=list)

    def problem(self, name: str, reason: str) -> None:
        self.problems.append((name, reason))

    def section(self, raw: Any, prefix: str, known: set[str], required: bool = False) -> dict:
        name = prefix.rstrip(".") or "job"
        if raw is None:
            if required:
                self.problem(name, "missing")
            return {}
        if not isinstance(raw, dict):
            self.problem(name, "must be an object")
            return {}
        for key in raw:
            if key in OUT_OF_SCOPE:
                self.problem(prefix + key, OUT_OF_SCOPE[key] + _WHY)
            elif key not in known:
                self.problem(prefix + key[:64], f"unknown field (expected {', '.join(sorted(known))})")
        return raw

    def text(
        self, raw: dict, key: str, prefix: str = "", required: bool = False, most: int | None = MAX_NAME
    ) -> str:
        """A string of at most `most` characters (None: the expert's fields, whose bounds are the
        manifest's)."""
        value = raw.get(key)
        if value is None or value == "":
            if required:
                self.problem(prefix + key, "missing")
            return ""
        if not isinstance(value, str):
            self.problem(prefix + key, "must be a string")
            return ""
        if most is not None and len(value) > most:
            self.problem(prefix + key, f"is {len(value)} characters long; the limit is {most}")
            return ""
        return value.strip()

    def integer(
        self,
        raw: dict,
        key: str,
        prefix: str,
        minimum: int,
        default: int | None = None,
        maximum: int = INT32_MAX,
    ) -> int | None:
        """An integer in [minimum, maximum]: at most an int32 by default, as the gRPC messages carry
        it (a deployment's own ceilings are reception's, libs.training.bounds.setting_violations)."""
        value = raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(prefix + key, f"must be an integer, got {_shown(value)}")
            return default
        if not minimum <= value <= maximum:
            self.problem(prefix + key, f"must be in [{minimum}, {maximum}], got {_shown(value)}")
            return default
        return value

    def number(self, raw: dict, key: str, prefix: str, default: float, maximum: float) -> float:
        """A finite number at most `maximum` (the lower bounds are TrainSettings')."""
        value = raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(prefix + key, f"must be a finite number, got {_shown(value)}")
            return default
        # Compared before any conversion: an integer too large for a float is refused, not raised on.
        if isinstance(value, float) and not math.isfinite(value):
            self.problem(prefix + key, f"must be a finite number, got {value}")
            return default
        if value > maximum:
            self.problem(prefix + key, f"must be at most {maximum:g}, got {_shown(value)}")
            return default
        return float(value)

    def strings(self, raw: dict, key: str, prefix: str, most: int) -> tuple[str, ...] | None:
        value = raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            self.problem(prefix + key, "must be a list of non-empty strings")
            return None
        if len(value) > most:
            self.problem(prefix + key, f"at most {most} entries, got {len(value)}")
            return None
        return tuple(v.strip() for v in value)


def _shown(value: Any) -> str:
    """A value as a refusal shows it: short, whatever it is (an integer of thousands of digits, a
    megabyte of text)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value) if isinstance(value, str | int | float | bool) else f"a {type(value).__name__}"
    return text if len(text) <= 64 else text[:64] + "…"
