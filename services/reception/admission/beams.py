"""The rules of `best_of` and beam search on an InferenceRequest (docs/api.md#best_of-and-beam-search).

vLLM's rules: best_of is at least n; beam search needs two beams or more and ranks continuations by
the model's own log-probabilities, so every field that samples, reshapes or constrains them is
refused by name rather than ignored; the scoring fields apply only with beams.
"""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2
from libs.limits import MAX_CHOICES

EARLY_STOPPING = ("true", "false", "never")
MAX_LENGTH_PENALTY = 10.0
# Fields a beam search refuses when set to anything but their neutral value.
_NEUTRAL = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def early_stopping_word(value: bool | str) -> str:
    """InferenceRequest.early_stopping for a JSON body's value (true, false or "never"; anything
    else is passed on as text, for validation to refuse by name)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def beam_problems(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    """Every problem with the request's best_of and beam-search fields, each naming its field."""
    n = request.n if request.HasField("n") else 1
    problems = []
    if request.HasField("best_of") and not n <= request.best_of <= MAX_CHOICES:
        problems.append(
            ("request.best_of", f"must be in [n, {MAX_CHOICES}] (n = {n}), got {request.best_of}")
        )
    problems += _scoring(request)
    if request.use_beam_search:
        problems += _beam_fields(request, request.best_of if request.HasField("best_of") else n)
    return problems


def _scoring(request: common_pb2.InferenceRequest) -> list[tuple[str, str]]:
    problems = []
    if request.HasField("length_penalty") and not abs(request.length_penalty) <= MAX_LENGTH_PENALTY:
        problems.append(
            ("request.length_penalty", f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        )
    if request.HasField("early_stopping") and request.early_stopping not in EARLY_STOPPING:
        problems.append(
            ("request.early_stopping", f'must be "true", "false" or "never", got {request.early_stopping!r}')
        )
    if not request.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if request.HasField(name):
                problems.append((f"request.{name}", "only applies with use_beam_search"))
    return problems


def _beam_fields(request: common_pb2.InferenceRequest, beams: int) -> list[tuple[str, str]]:
    problems = []
    if beams < 2:
        problems.append(("request.best_of", "beam search needs at least 2 beams (best_of, else n)"))
    if request.HasField("temperature") and request.temperature != 0.0:
        problems.append(("request.temperature", "must be 0 with use_beam_search (beams are not sampled)"))
    for name, neutral in _NEUTRAL.items():
        if request.HasField(name) and getattr(request, name) != neutral:
            problems.append((f"request.{name}", f"must be {neutral} with use_beam_search"))
    refused = (
        ("stop", bool(request.stop), "stop strings are not supported with use_beam_search"),
        ("logprobs", request.HasField("logprobs"), "is not supported with use_beam_search"),
        ("json_schema", request.HasField("json_schema"), "a format is not supported with use_beam_search"),
        (
            "response_format",
            request.response_format.WhichOneof("format") is not None,
            "a format is not supported with use_beam_search",
        ),
        ("tools", bool(request.tools), "tools are not supported with use_beam_search"),
        ("speculative", request.HasField("speculative") and request.speculative, "beams are never drafted"),
    )
    problems += [(f"request.{name}", why) for name, bad, why in refused if bad]
    return problems
