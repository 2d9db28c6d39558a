"""A training run's settings, checked when made (each problem names the command-line option); kept
apart from the trainer so that reception reads job specs without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from libs.experts.projections import INPUT_SCALABLE, PROJECTIONS
from libs.training.bounds import MAX_ALPHA, MAX_LEARNING_RATE, MAX_MODULES, MAX_SEED, MAX_VIRTUAL_TOKENS

ADAPTER_TYPES = ("lora", "ia3", "prompt-tuning")
# The modules an adapter may target: the projections the engine applies adapters to; an IA3 adapter
# may scale only the inputs of INPUT_SCALABLE_MODULES.
ADAPTABLE_MODULES = PROJECTIONS
INPUT_SCALABLE_MODULES = INPUT_SCALABLE
# Adapters with fewer parameters need larger steps (PEFT's own examples use about these).
DEFAULT_LEARNING_RATES = {"lora": 1e-3, "ia3": 1e-2, "prompt-tuning": 3e-2}


class SettingsError(ValueError):
    """A training setting out of range; the message names the option."""


@dataclass(frozen=True)
class TrainSettings:
    adapter_type: str = "lora"
    rank: int = 8  # LoRA
    alpha: float = 16.0  # LoRA
    dropout: float = 0.05  # LoRA
    target_modules: tuple[str, ...] | None = None  # LoRA: ADAPTABLE_MODULES; IA³: peft's default
    feedforward_modules: tuple[str, ...] | None = None  # IA³
    num_virtual_tokens: int = 20  # prompt tuning
    epochs: int = 3
    max_steps: int | None = None  # None: every step of `epochs`; else at most this many optimizer steps
    learning_rate: float | None = None  # None: DEFAULT_LEARNING_RATES by type
    batch_size: int = 8
    eval_fraction: float = 0.1
    patience: int = 1  # epochs without a better eval loss before stopping
    seed: int = 0
    max_length: int | None = None  # None: the model's context length
    device: str | None = None  # None: CUDA when present, else the CPU

    def __post_init__(self) -> None:
        for option, ok, problem in (*self._lower_bounds(), *self._ceilings()):
            if not ok:
                raise SettingsError(f"{option}: {problem}")
        for option, problem in module_problems(
            self.adapter_type, self.target_modules, self.feedforward_modules
        ):
            raise SettingsError(f"{option}: {problem}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise SettingsError(f"--device: {self.device!r} is not cpu, cuda or cuda:N")

    def _lower_bounds(self) -> tuple[tuple[str, bool, str], ...]:
        return (
            ("--type", self.adapter_type in ADAPTER_TYPES, f"must be one of {', '.join(ADAPTER_TYPES)}"),
            ("--rank", self.rank >= 1, "must be at least 1"),
            ("--alpha", self.alpha > 0, "must be positive"),
            ("--dropout", 0.0 <= self.dropout < 1.0, "must be in [0, 1)"),
            ("--virtual-tokens", self.num_virtual_tokens >= 1, "must be at least 1"),
            ("--epochs", self.epochs >= 1, "must be at least 1"),
            ("--max-steps", self.max_steps is None or self.max_steps >= 1, "must be at least 1"),
            ("--lr", self.learning_rate is None or self.learning_rate > 0, "must be positive"),
            ("--batch-size", self.batch_size >= 1, "must be at least 1"),
            ("--eval-fraction", 0.0 <= self.eval_fraction < 1.0, "must be in [0, 1)"),
            ("--patience", self.patience >= 1, "must be at least 1"),
            ("--seed", self.seed >= 0, "must be at least 0"),
            ("--max-length", self.max_length is None or self.max_length >= 2, "must be at least 2"),
        )

    def _ceilings(self) -> tuple[tuple[str, bool, str], ...]:
        """The ceilings that hold everywhere (libs/training/bounds.py says why each value); a
        deployment's own, EXPERT_TRAINING_MAX_*, are its reception's to check."""
        return (
            ("--alpha", self.alpha <= MAX_ALPHA, f"must be at most {MAX_ALPHA:g}"),
            (
                "--virtual-tokens",
                self.num_virtual_tokens <= MAX_VIRTUAL_TOKENS,
                f"must be at most {MAX_VIRTUAL_TOKENS}",
            ),
            (
                "--lr",
                self.learning_rate is None or self.learning_rate <= MAX_LEARNING_RATE,
                f"must be at most {MAX_LEARNING_RATE:g}",
            ),
            ("--seed", self.seed <= MAX_SEED, f"must be at most {MAX_SEED}"),
        )

    @property
    def lr(self) -> float:
        return self.learning_rate or DEFAULT_LEARNING_RATES[self.adapter_type]

    @property
    def reserved_tokens(self) -> int:
        """Positions a sample gives up to the adapter (a soft prompt's virtual tokens)."""
        return self.num_virtual_tokens if self.adapter_type == "prompt-tuning" else 0


def module_problems(
    adapter_type: str, targets: tuple[str, ...] | None, feedforward: tuple[str, ...] | None
) -> list[tuple[str, str]]:
    """(option, problem) for modules an adapter of `adapter_type` cannot have: a name the engine
    applies no adapter to (peft would find it in no base model the engine serves, or the engine would
    refuse the trained expert), feed-forward modules outside the targets (peft's rule) or beyond the
    inputs the engine scales, and either list on an adapter type that has none."""
    problems = []
    if targets is not None:
        problems += _list_problems("--target-modules", targets, ADAPTABLE_MODULES)
        if adapter_type == "prompt-tuning":
            problems.append(("--target-modules", "a soft prompt has no target modules"))
    if feedforward is not None:
        problems += _list_problems("--feedforward-modules", feedforward, INPUT_SCALABLE_MODULES)
        if adapter_type != "ia3":
            problems.append(("--feedforward-modules", f"only an ia3 adapter has them, not {adapter_type}"))
        elif targets is None or not set(feedforward) <= set(targets):
            problems.append(("--feedforward-modules", "must be among the target modules, given with them"))
    return problems


def _list_problems(option: str, names: tuple[str, ...], allowed: tuple[str, ...]) -> list[tuple[str, str]]:
    if not names:
        return [(option, "empty")]
    if len(names) > MAX_MODULES:
        return [(option, f"at most {MAX_MODULES} entries, got {len(names)}")]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        return [(option, f"{unknown[0][:64]!r} is not one of {', '.join(allowed)}")]
    return []
