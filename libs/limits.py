"""The limits of a request, each written once: the bounds of its sampling values, how many choices,
logprobs and experts it may ask for, and which of its fields are sampling (docs/design.md#validation-rules).

Reception's validation, the router, the engine's `SamplingParams` and its adapter manager import
them from here; nothing here imports torch or gRPC, so a service pays nothing for it.
`sampling_problems` is the one check of sampling values, in the manner of vLLM's
`SamplingParams._verify_args`: every value outside its bound, named by its field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

MAX_EXPERTS = 10  # experts one request may use: forced, chosen by the router, or given to the engine
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the engine's batch
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM's logprobs
MAX_TOKENS = 200_000  # the most tokens one request may ask to generate
MAX_TOOLS = 128  # functions one request may offer (OpenAI's bound)
MAX_TOOL_NAME_CHARS = 64  # a function's name: 1-64 of a-z, A-Z, 0-9, _ and - (OpenAI's rule)
MAX_TOOL_DESCRIPTION_CHARS = 4_096  # shown to the model, so part of the prompt's cost
MAX_TOOLS_BYTES = 64 * 1024  # every tool's parameter schema together: the grammar the engine compiles

# The fields that pick tokens, named alike in InferenceRequest, SessionSampling, GenerationParams
# and SamplingParams: a session's sampling, the user's overrides of the router's tuning and an
# OpenAI body's fields are these (each with its own token limit, stop strings, n and logprobs).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


@dataclass(frozen=True)
class Bound:
    """The values a field takes: from `low` (excluded when `low_open`) to `high` (None: no upper
    bound); an `integer` field takes integers only. `note` follows the bound in a refusal."""

    low: float
    high: float | None
    low_open: bool = False
    integer: bool = False
    note: str = ""

    def __str__(self) -> str:
        if self.high is None:
            text = f"{'>' if self.low_open else '>='} {_shown(self.low)}"
        else:
            text = f"in {'(' if self.low_open else '['}{_shown(self.low)}, {_shown(self.high)}]"
        return f"{text} ({self.note})" if self.note else text

    def problem(self, value: object) -> str | None:
        """Why `value` is refused; None when it is in bounds. NaN and infinities never are."""
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"expected {'an integer' if self.integer else 'a number'}, got {value!r}"
        above_low = self.low < value if self.low_open else self.low <= value  # False for NaN
        if above_low and (self.high is None or value <= self.high):
            return None
        return f"must be {self}, got {_value(value)}"


# The public API's bounds (docs/api.md#inferencerequest-validation), in the order they are checked.
API_BOUNDS: Mapping[str, Bound] = MappingProxyType(
    {
        "temperature": Bound(0.0, 2.0),
        "max_tokens": Bound(1, MAX_TOKENS, integer=True),
        "top_p": Bound(0.0, 1.0, low_open=True),
        "top_k": Bound(0, None, integer=True, note="0 = off"),
        "min_p": Bound(0.0, 1.0),
        "repetition_penalty": Bound(1.0, 2.0),
        "presence_penalty": Bound(-2.0, 2.0),
        "frequency_penalty": Bound(-2.0, 2.0),
        "seed": Bound(0, 2**64 - 1, integer=True),
        "n": Bound(1, MAX_CHOICES, integer=True),
        "logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    }
)

# The engine library takes more than the public API, for one reason: it also runs in-process
# (LLMEngine.generate, AsyncLLMEngine; docs/api.md#samplingparams), where its caller owns the whole
# engine instead of sharing a fleet, and where vLLM's SamplingParams is the contract:
# - n up to ENGINE_MAX_CHOICES (the default max_num_seqs): an in-process caller may fill the batch
#   it owns, while a served request shares it with others, so the API gives one at most MAX_CHOICES;
# - repetition_penalty in (0, 2], vLLM's lower bound: below 1 rewards repetition, which no API
#   client needs, but a checkpoint's generation_config.json may recommend it, and the router hands
#   that recommendation to the engine without reception seeing it;
# - top_k -1, vLLM's "off" (made 0), and max_tokens bounded only by the context window.
# A client's own values never reach these: reception refuses what is outside API_BOUNDS first.
ENGINE_MAX_CHOICES = 64
ENGINE_BOUNDS: Mapping[str, Bound] = MappingProxyType(
    {
        **API_BOUNDS,
        "max_tokens": Bound(1, None, integer=True),
        "top_k": Bound(-1, None, integer=True, note="-1 or 0 = off"),
        "repetition_penalty": Bound(0.0, 2.0, low_open=True),
        "n": Bound(1, ENGINE_MAX_CHOICES, integer=True),
    }
)


def sampling_problems(
    values: Mapping[str, object], bounds: Mapping[str, Bound] = API_BOUNDS
) -> list[tuple[str, str]]:
    """Every value of `values` (field -> value; a field left out is not checked) outside its bound
    in `bounds`, as (field, description) pairs in the order of `bounds`."""
    problems = []
    for name, bound in bounds.items():
        if name in values:
            problem = bound.problem(values[name])
            if problem is not None:
                problems.append((name, problem))
    return problems


def _shown(value: float) -> str:
    """A bound as a person writes it: 2, 0.5, 65."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def _value(value: float) -> str:
    """A refused value as it was given: 3 for an int, 3.0 for a float, and a float32 field's 0.9 as
    0.9 rather than 0.8999999761581421 (seven significant digits, all a float32 holds)."""
    return str(value) if isinstance(value, int) else repr(float(f"{value:.7g}"))
