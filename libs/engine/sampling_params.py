"""Per-request generation settings, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from libs.engine.errors import InvalidRequestError
from libs.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 64


class OutputKind(Enum):
    """What each streamed RequestOutput holds: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


def _number(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise InvalidRequestError(name, f"expected {'an integer' if integer else 'a number'}, got {value!r}")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy; top_k 0 (or -1), top_p 1 and min_p 0 switch those filters off. Penalties
    follow vLLM: repetition divides positive / multiplies negative logits of tokens already in the
    prompt or output; presence and frequency subtract per output-token occurrence. Unlike vLLM, none
    touches the eos ids, the stop_token_ids or the tokenizer's control tokens. A seed makes the
    sampled tokens reproducible whatever else shares the batch. `stop` strings never appear in the
    output text (unless include_stop_str_in_output). `logprobs` N returns the N most likely tokens
    per position (0: only the sampled token's). `structured` constrains every output to a format
    (JSON, a JSON schema, a regex or a grammar): only tokens that keep the output a prefix of one
    the format accepts are sampled, and an end-of-sequence token only where the format can end.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = OutputKind.CUMULATIVE
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError("stop", f"expected a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise InvalidRequestError(
                "stop_token_ids", f"expected a list of token ids, got {self.stop_token_ids!r}"
            )
        self._validate()
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        _number("n", self.n, integer=True)
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {self.n}")
        _number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature", f"must be in [0, 2], got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (off) or a positive integer, got {self.top_k}"
            )
        _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            _number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**64:
                raise InvalidRequestError("seed", f"must be in [0, 2^64), got {self.seed}")
        if self.max_tokens is not None:
            _number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 1:
                raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop[{i}]", "must be a non-empty string")
        for i, token in enumerate(self.stop_token_ids):
            _number(f"stop_token_ids[{i}]", token, integer=True)
            if token < 0:
                raise InvalidRequestError(f"stop_token_ids[{i}]", f"must be a token id >= 0, got {token}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"expected true or false, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, OutputKind):
            raise InvalidRequestError("output_kind", f"expected an OutputKind, got {self.output_kind!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(
                "structured", f"expected a StructuredOutput, got {type(self.structured).__name__}"
            )
        if self.logprobs is not None:
            _number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
