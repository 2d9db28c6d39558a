"""A training run's settings, checked when made (each problem names the command-line option); kept
apart from the trainer so that reception reads job specs without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

ADAPTER_TYPES = ("lora", "ia3", "prompt-tuning")
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
    target_modules: tuple[str, ...] | None = None  # LoRA: LORA_TARGETS; IA³: peft's default for the model
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
        checks = (
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
            ("--max-length", self.max_length is None or self.max_length >= 2, "must be at least 2"),
            ("--target-modules", self.target_modules is None or len(self.target_modules) > 0, "empty"),
        )
        for option, ok, problem in checks:
            if not ok:
                raise SettingsError(f"{option}: {problem}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise SettingsError(f"--device: {self.device!r} is not cpu, cuda or cuda:N")

    @property
    def lr(self) -> float:
        return self.learning_rate or DEFAULT_LEARNING_RATES[self.adapter_type]

    @property
    def reserved_tokens(self) -> int:
        """Positions a sample gives up to the adapter (a soft prompt's virtual tokens)."""
        return self.num_virtual_tokens if self.adapter_type == "prompt-tuning" else 0
