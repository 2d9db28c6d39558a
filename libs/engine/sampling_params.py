"""Per-request generation settings, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from libs.engine.beam_params import check_beam_search
from libs.engine.errors import InvalidRequestError
from libs.limits import ENGINE_BOUNDS, Bound, sampling_problems
from libs.structured_output import StructuredOutput

# Fields whose None means "not set" (no seed, the rest of the context, no logprobs): not checked then.
_UNSET_IS_NONE = ("seed", "max_tokens", "logprobs")
_TOKEN_ID = Bound(0, None, integer=True, note="a token id")


class OutputKind(Enum):
    """What each streamed RequestOutput holds: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


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

    `best_of` (vLLM's and OpenAI's): that many outputs are generated and the `n` with the highest
    cumulative logprob returned. `use_beam_search`: beam search with `best_of` beams (else `n`),
    returning the `n` best (beam_search.py); `length_penalty` and `early_stopping` as transformers'
    `generate(num_beams=...)`. Beams rank by the model's own probabilities, so they refuse what
    reshapes or randomises them (temperature > 0, top-p/k, min-p, penalties, formats), as vLLM did.
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
    # Speculative decoding for this request: True/False, or None for the engine's setting
    # (EXPERT_SPECULATIVE). True on an engine without a drafter decodes as usual.
    speculative: bool | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

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
        check_beam_search(self)
        if self.use_beam_search:
            self.speculative = False  # a beam's next tokens are ranked, never drafted

    def _validate(self) -> None:
        """The sampling values against the engine's bounds (libs.limits: wider than the public
        API's where an in-process caller needs it), then the fields only the engine has."""
        values = {
            name: getattr(self, name)
            for name in ENGINE_BOUNDS
            if getattr(self, name) is not None or name not in _UNSET_IS_NONE
        }
        for name, problem in sampling_problems(values, ENGINE_BOUNDS):
            raise InvalidRequestError(name, problem)
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop[{i}]", "must be a non-empty string")
        for i, token in enumerate(self.stop_token_ids):
            problem = _TOKEN_ID.problem(token)
            if problem is not None:
                raise InvalidRequestError(f"stop_token_ids[{i}]", problem)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculative"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "speculative" and value is None):
                raise InvalidRequestError(name, f"expected true or false, got {value!r}")
        if not isinstance(self.output_kind, OutputKind):
            raise InvalidRequestError("output_kind", f"expected an OutputKind, got {self.output_kind!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(
                "structured", f"expected a StructuredOutput, got {type(self.structured).__name__}"
            )

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs: its beams, or best_of samples, or its n outputs."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_outputs(self) -> bool:
        """Whether the n outputs are picked from more samples by cumulative logprob (best_of > n)."""
        return not self.use_beam_search and self.num_seqs > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
