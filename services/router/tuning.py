"""Parameter tuning (docs/design.md#parameter-tuning): defaults by task type, over them the
sampling the model's checkpoint recommends, a deployment's ceiling on the default max_tokens, then
the user's explicit values win."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from libs.gen.expert.v1 import common_pb2
from libs.limits import SAMPLING_FIELDS
from services.router.features import Features


@dataclass(frozen=True)
class Tuning:
    temperature: float
    max_tokens: int
    top_p: float
    repetition_penalty: float


# The defaults by task type; every other task type gets the default row. A regex or a grammar is
# tuned as JSON is: the output must follow a format, and a penalty on repeated tokens would fight
# the tokens the format needs again and again (quotes, brackets, separators).
_STRUCTURED = Tuning(temperature=0.2, max_tokens=2048, top_p=0.95, repetition_penalty=1.0)
TASK_DEFAULTS = {
    "json_parsing": _STRUCTURED,
    "structured_output": _STRUCTURED,
    "creative_writing": Tuning(temperature=0.8, max_tokens=4096, top_p=0.95, repetition_penalty=1.1),
    "code_generation": Tuning(temperature=0.4, max_tokens=8192, top_p=0.95, repetition_penalty=1.05),
}
DEFAULT = Tuning(temperature=0.6, max_tokens=2048, top_p=0.95, repetition_penalty=1.1)

# Request fields copied to the generation parameters whenever the user set them.
_OVERRIDES = (*SAMPLING_FIELDS, "max_tokens", "n", "logprobs", "ignore_eos", "skip_special_tokens")


# Without a user max_tokens, no more than this (EXPERT_ROUTER_MAX_TOKENS_DEFAULT): the table's
# budgets suit a large model, and a small one that misses its end token runs to them.
DEFAULT_MAX_TOKENS_CEILING = 512
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")


def tune_parameters(
    features: Features,
    request: common_pb2.InferenceRequest,
    max_model_len: int | None = None,
    model_defaults: common_pb2.SamplingDefaults | None = None,
    max_tokens_ceiling: int = DEFAULT_MAX_TOKENS_CEILING,
) -> tuple[common_pb2.GenerationParams, list[str]]:
    """Generation parameters for the request, and one trace line per decision.

    In order: the task type's row of the table; the model's own recommended sampling
    (`model_defaults`, from its generation_config.json) over it; without an explicit max_tokens,
    the deployment's ceiling and then the context window cap the table's budget; last, every value
    the user set.
    """
    base = TASK_DEFAULTS.get(features.task_type, DEFAULT)
    trace = [
        f"tuning: task {features.task_type} -> temperature {base.temperature}, max_tokens {base.max_tokens}, "
        f"top_p {base.top_p}, repetition_penalty {base.repetition_penalty} (the task-type table)"
    ]
    params = common_pb2.GenerationParams(
        temperature=base.temperature,
        max_tokens=base.max_tokens,
        top_p=base.top_p,
        repetition_penalty=base.repetition_penalty,
        stop=list(request.stop),
    )
    recommended = [n for n in _MODEL_DEFAULTS if model_defaults is not None and model_defaults.HasField(n)]
    if recommended:
        for name in recommended:
            setattr(params, name, getattr(model_defaults, name))
        trace.append(
            "tuning: the model's generation_config.json sets "
            + ", ".join(f"{n} {_shown(getattr(model_defaults, n))}" for n in recommended)
            + " (over the table)"
        )
    if not request.HasField("max_tokens"):
        if params.max_tokens > max_tokens_ceiling:
            trace.append(
                f"tuning: max_tokens {max_tokens_ceiling}, the deployment's ceiling "
                f"(EXPERT_ROUTER_MAX_TOKENS_DEFAULT), under the table's {params.max_tokens}"
            )
            params.max_tokens = max_tokens_ceiling
        window = request.context_size if request.HasField("context_size") else max_model_len
        if window and params.max_tokens > window // 2:
            params.max_tokens = max(1, window // 2)
            trace.append(
                f"tuning: max_tokens capped at {params.max_tokens} (half the {window}-token context)"
            )
    for name in _OVERRIDES:
        if request.HasField(name):
            setattr(params, name, getattr(request, name))
            trace.append(f"tuning: {name} = {_shown(getattr(request, name))} (user)")
    return params, trace


def _shown(value: float | int) -> str:
    """A field's value as its sender wrote it: an integer as is, a float32 field as the shortest
    decimal that reads back as the same float32 (0.3, not 0.30000001192092896, which is what the
    float32 0.3 is as a Python float; 1e-05; 0.1234567)."""
    if not isinstance(value, float):
        return repr(value)
    single = struct.pack("<f", value)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        text = f"{value:.{digits}g}"
        if struct.pack("<f", float(text)) == single:
            return text
    return repr(value)
