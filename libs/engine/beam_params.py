"""The checks of `best_of` and the beam-search settings of a SamplingParams (vLLM's rules).

Kept apart from sampling_params.py so that the rules a beam search imposes on the other sampling
fields are written in one place, next to the reason for each.
"""

from __future__ import annotations

import math
from typing import Any

from libs.engine.errors import InvalidRequestError
from libs.limits import ENGINE_MAX_CHOICES

EARLY_STOPPING = (
    True,
    False,
    "never",
)  # transformers' values: stop at num_beams hypotheses, heuristic, never
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: beyond it a score is only the length


def check_beam_search(params: Any) -> None:
    """InvalidRequestError naming the field for a best_of / beam-search setting the engine refuses."""
    best_of = params.best_of
    if best_of is not None:
        if isinstance(best_of, bool) or not isinstance(best_of, int):
            raise InvalidRequestError("best_of", f"expected an integer, got {best_of!r}")
        if not params.n <= best_of <= ENGINE_MAX_CHOICES:
            raise InvalidRequestError(
                "best_of", f"must be in [n, {ENGINE_MAX_CHOICES}] (n = {params.n}), got {best_of}"
            )
    if not isinstance(params.use_beam_search, bool):
        raise InvalidRequestError(
            "use_beam_search", f"expected true or false, got {params.use_beam_search!r}"
        )
    _check_scoring(params)
    if params.use_beam_search:
        _check_beam_fields(params)


def _check_scoring(params: Any) -> None:
    penalty, early = params.length_penalty, params.early_stopping
    if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not math.isfinite(penalty):
        raise InvalidRequestError("length_penalty", f"expected a number, got {penalty!r}")
    if abs(penalty) > MAX_LENGTH_PENALTY:
        raise InvalidRequestError(
            "length_penalty", f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {penalty}"
        )
    if not (early is True or early is False or early == "never"):
        raise InvalidRequestError("early_stopping", f'expected true, false or "never", got {early!r}')
    # vLLM's rule: without beams these settings would be silently ignored, so they are refused.
    if not params.use_beam_search:
        if penalty != 1.0:
            raise InvalidRequestError("length_penalty", "only applies with use_beam_search")
        if early is not False:
            raise InvalidRequestError("early_stopping", "only applies with use_beam_search")


def _check_beam_fields(params: Any) -> None:
    """Beams rank continuations by the model's own log-probabilities: anything that samples,
    reshapes the distribution or constrains it is refused rather than ignored."""
    if params.num_seqs < 2:
        raise InvalidRequestError("best_of", "beam search needs at least 2 beams (best_of, else n)")
    refused = (
        ("temperature", params.temperature != 0.0, "must be 0 with use_beam_search (beams are not sampled)"),
        ("top_p", params.top_p != 1.0, "must be 1 with use_beam_search"),
        ("top_k", params.top_k not in (0, -1), "must be 0 (off) with use_beam_search"),
        ("min_p", params.min_p != 0.0, "must be 0 with use_beam_search"),
        ("repetition_penalty", params.repetition_penalty != 1.0, "must be 1 with use_beam_search"),
        ("presence_penalty", params.presence_penalty != 0.0, "must be 0 with use_beam_search"),
        ("frequency_penalty", params.frequency_penalty != 0.0, "must be 0 with use_beam_search"),
        (
            "stop",
            bool(params.stop),
            "stop strings are not supported with use_beam_search (stop_token_ids are)",
        ),
        ("logprobs", params.logprobs is not None, "is not supported with use_beam_search"),
        ("structured", params.structured is not None, "a format is not supported with use_beam_search"),
        ("speculative", params.speculative is True, "beams are never drafted: leave it unset or false"),
    )
    for name, bad, why in refused:
        if bad:
            raise InvalidRequestError(name, why)
