"""OpenAI's fine-tuning job request (`POST /v1/fine_tuning/jobs`) read into the training job spec of
docs/api.md#training-jobs, which TrainingAdmission checks and queues: this module only renames.

What has no counterpart here is refused by name rather than ignored: `method.type` dpo and
reinforcement (a job trains a supervised adapter), `integrations` (no Weights & Biases from a
deployment that reaches nothing outside it) and `metadata` (a job record keeps no free-form pairs).
A spec problem the admission finds names the seed field; SEED_TO_OPENAI names it as OpenAI's client
sent it."""

from __future__ import annotations

import re
import secrets
from typing import Any

from libs.errors import invalid_arguments
from libs.experts.manifest import NAME_PATTERN
from libs.training.bounds import MAX_LEARNING_RATE_MULTIPLIER
from libs.training.settings import DEFAULT_LEARNING_RATES

ADAPTER = "lora"  # what an OpenAI job trains: the adapter whose default learning rate the multiplier scales
KNOWN = {
    "model",
    "training_file",
    "validation_file",
    "hyperparameters",
    "suffix",
    "seed",
    "method",
    "integrations",
    "metadata",
}
HYPERPARAMETERS = {"n_epochs", "batch_size", "learning_rate_multiplier"}
REFUSED_METHODS = {
    "dpo": "preference optimisation (DPO) is not offered: a job trains a supervised adapter",
    "reinforcement": "reinforcement fine-tuning is not offered: a job trains a supervised adapter",
}
# Fields of the seed spec (as the admission names them) -> OpenAI's names.
SEED_TO_OPENAI = {
    "hyperparameters.epochs": "hyperparameters.n_epochs",
    "hyperparameters.learning_rate": "hyperparameters.learning_rate_multiplier",
    "hyperparameters.seed": "seed",
    "expert.name": "suffix",
    "base_model": "model",
}
_NAME = re.compile(NAME_PATTERN)


def to_job_spec(body: Any) -> dict[str, Any]:
    """The seed spec for OpenAI's request `body`; raises INVALID_ARGUMENT naming every bad field."""
    problems: list[tuple[str, str]] = []
    if not isinstance(body, dict):
        raise invalid_arguments([("body", "must be a JSON object")])
    problems += [(key, "unknown parameter") for key in body if key not in KNOWN]
    for key in ("model", "training_file"):
        if not isinstance(body.get(key), str) or not body[key].strip():
            problems.append((key, "missing (a non-empty string)"))
    if body.get("validation_file") is not None and not isinstance(body["validation_file"], str):
        problems.append(("validation_file", "must be a string"))
    if body.get("integrations"):
        problems.append(("integrations", "not supported: this deployment reports to no outside service"))
    if body.get("metadata"):
        problems.append(("metadata", "not supported: a job keeps no metadata"))
    hyper = _hyperparameters(body, problems)
    suffix = _suffix(body.get("suffix"), problems)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        problems.append(("seed", f"must be a non-negative integer, got {seed!r}"))
    if problems:
        raise invalid_arguments(problems)
    if seed is not None:
        hyper["seed"] = seed
    return {
        "base_model": body["model"].strip(),
        "training_file": body["training_file"].strip(),
        "validation_file": (body.get("validation_file") or "").strip(),
        "adapter": {"type": ADAPTER},
        "hyperparameters": hyper,
        "expert": {
            "name": suffix,
            "description": f"Fine-tuned through the fine-tuning API on {body['training_file'].strip()}.",
        },
    }


def _suffix(value: Any, problems: list[tuple[str, str]]) -> str:
    """The produced expert's name: the suffix, else a fresh `ft-` name."""
    if value is None or value == "":
        return "ft-" + secrets.token_hex(4)
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        problems.append(
            ("suffix", f"must match {NAME_PATTERN} (it names the expert, the model's part after ':')")
        )
        return ""
    return value


def _given_hyperparameters(body: dict, problems: list[tuple[str, str]]) -> tuple[Any, str]:
    """`hyperparameters` or `method.supervised.hyperparameters` (None: neither), and its name."""
    raw, where = body.get("hyperparameters"), "hyperparameters"
    method = body.get("method")
    if method is not None:
        nested = _method_hyperparameters(method, problems)
        if nested is not None and raw is not None:
            problems.append(("hyperparameters", "give it here or in method.supervised, not both"))
        elif nested is not None:
            raw, where = nested, "method.supervised.hyperparameters"
    return raw, where


def _hyperparameters(body: dict, problems: list[tuple[str, str]]) -> dict[str, Any]:
    """The seed hyperparameters of OpenAI's ("auto": the trainer's default)."""
    raw, where = _given_hyperparameters(body, problems)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append((where, "must be an object"))
        return {}
    problems += [(f"{where}.{k}", "unknown parameter") for k in raw if k not in HYPERPARAMETERS]
    hyper: dict[str, Any] = {}
    for name, seed_name in (("n_epochs", "epochs"), ("batch_size", "batch_size")):
        value = raw.get(name, "auto")
        if value == "auto" or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append((f"{where}.{name}", f"must be 'auto' or an integer >= 1, got {_shown(value)}"))
        else:
            hyper[seed_name] = value  # its ceiling (EXPERT_TRAINING_MAX_*) is the admission's
    multiplier = raw.get("learning_rate_multiplier", "auto")
    if multiplier not in ("auto", None):
        # Compared as given: NaN fails it, and an integer too large for a float is refused unconverted.
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, int | float)
            or not 0 < multiplier <= MAX_LEARNING_RATE_MULTIPLIER
        ):
            most = MAX_LEARNING_RATE_MULTIPLIER
            reason = f"must be 'auto' or a number in (0, {most:g}], got {_shown(multiplier)}"
            problems.append((f"{where}.learning_rate_multiplier", reason))
        else:
            hyper["learning_rate"] = DEFAULT_LEARNING_RATES[ADAPTER] * float(multiplier)
    return hyper


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str | int | float) else f"a {type(value).__name__}"
    return text if len(text) <= 64 else text[:64] + "…"


def openai_names(body: Any) -> dict[str, str]:
    """SEED_TO_OPENAI for this request: a hyperparameter named where the request gave it
    (`method.supervised.hyperparameters` or the deprecated top-level `hyperparameters`)."""
    where = "hyperparameters"
    if isinstance(body, dict) and body.get("hyperparameters") is None:
        method = body.get("method")
        supervised = method.get("supervised") if isinstance(method, dict) else None
        if isinstance(supervised, dict) and "hyperparameters" in supervised:
            where = "method.supervised.hyperparameters"
    names = {**SEED_TO_OPENAI, "hyperparameters.batch_size": "hyperparameters.batch_size"}
    return {
        seed: name.replace("hyperparameters", where, 1) if name.startswith("hyperparameters.") else name
        for seed, name in names.items()
    }


def _method_hyperparameters(method: Any, problems: list[tuple[str, str]]) -> dict | None:
    """`method.supervised.hyperparameters`, after refusing the methods a job cannot run."""
    if not isinstance(method, dict):
        problems.append(("method", "must be an object"))
        return None
    kind = method.get("type", "supervised")
    if kind in REFUSED_METHODS:
        problems.append(("method.type", f"{kind!r}: {REFUSED_METHODS[kind]}"))
    elif kind != "supervised":
        problems.append(("method.type", f"must be 'supervised', got {kind!r}"))
    problems += [
        (f"method.{k}", REFUSED_METHODS.get(k, "unknown parameter"))
        for k in method
        if k not in ("type", "supervised")
    ]
    supervised = method.get("supervised")
    if supervised is None:
        return None
    if not isinstance(supervised, dict):
        problems.append(("method.supervised", "must be an object"))
        return None
    problems += [
        (f"method.supervised.{k}", "unknown parameter") for k in supervised if k != "hyperparameters"
    ]
    return supervised.get("hyperparameters")
