"""Parameter tuning (docs/design.md#parameter-tuning): defaults by task type, then the user's
explicit values win."""

from __future__ import annotations

from dataclasses import dataclass, replace

from libs.gen.expert.v1 import common_pb2
from services.router.features import Features


@dataclass(frozen=True)
class Tuning:
    temperature: float
    max_tokens: int
    top_p: float
    repetition_penalty: float


# The defaults by task type; every other task type gets the default row.
TASK_DEFAULTS = {
    "json_parsing": Tuning(temperature=0.2, max_tokens=2048, top_p=0.95, repetition_penalty=1.0),
    "creative_writing": Tuning(temperature=0.8, max_tokens=4096, top_p=0.95, repetition_penalty=1.1),
    "code_generation": Tuning(temperature=0.4, max_tokens=8192, top_p=0.95, repetition_penalty=1.05),
}
DEFAULT = Tuning(temperature=0.6, max_tokens=2048, top_p=0.95, repetition_penalty=1.1)

# Request fields copied to the generation parameters whenever the user set them.
_OVERRIDES = (
    "temperature",
    "max_tokens",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def tune_parameters(
    features: Features, request: common_pb2.InferenceRequest, max_model_len: int | None = None
) -> tuple[common_pb2.GenerationParams, list[str]]:
    """Generation parameters for the request, and one trace line per decision.

    The task type's max_tokens is a budget, not a requirement: without an explicit max_tokens it is
    capped at the context window the request or the model allows.
    """
    base = TASK_DEFAULTS.get(features.task_type, DEFAULT)
    trace = [
        f"tuning: task {features.task_type} -> temperature {base.temperature}, max_tokens {base.max_tokens}, "
        f"top_p {base.top_p}, repetition_penalty {base.repetition_penalty}"
    ]
    window = request.context_size if request.HasField("context_size") else max_model_len
    if window and not request.HasField("max_tokens") and base.max_tokens > window // 2:
        base = replace(base, max_tokens=max(1, window // 2))
        trace.append(f"tuning: max_tokens capped at {base.max_tokens} (half the {window}-token context)")
    params = common_pb2.GenerationParams(
        temperature=base.temperature,
        max_tokens=base.max_tokens,
        top_p=base.top_p,
        repetition_penalty=base.repetition_penalty,
        stop=list(request.stop),
    )
    for name in _OVERRIDES:
        if request.HasField(name):
            setattr(params, name, getattr(request, name))
            trace.append(f"tuning: {name} = {getattr(request, name)!r} (user)")
    return params, trace
