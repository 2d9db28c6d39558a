"""Train a PEFT adapter (LoRA, IA³ or prompt tuning) on encoded samples with `peft` and `transformers`.

The base model is transformers' own implementation, wrapped by `peft`; only the adapter's parameters
train. The loss is the cross-entropy of the learned tokens only (the assistant's answers): the LM head
is applied to just the positions that predict one, which on short answers saves about a fifth of the
step. A held-out split is evaluated after every epoch; training stops early when its loss has not
improved for `patience` epochs, and the adapter of the best epoch is the one saved. One seed fixes the
split, the order of the batches, the initial weights and dropout, so a run on the same machine repeats.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tools.training.render import IGNORE, Encoded

ADAPTER_TYPES = ("lora", "ia3", "prompt-tuning")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapters with fewer parameters need larger steps (PEFT's own examples use about these).
DEFAULT_LEARNING_RATES = {"lora": 1e-3, "ia3": 1e-2, "prompt-tuning": 3e-2}
MIN_SHARED_HEAD = 8  # shorter shared heads are not worth a second forward call


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


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    train_loss: float
    eval_loss: float | None
    seconds: float
    tokens: int


@dataclass
class TrainReport:
    adapter_dir: str
    adapter_type: str
    device: str
    train_samples: int
    eval_samples: int
    trainable_parameters: int
    learning_rate: float
    epochs: list[EpochReport] = field(default_factory=list)
    best_epoch: int = 0
    stopped_early: bool = False
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        seconds = sum(e.seconds for e in self.epochs)
        return sum(e.tokens for e in self.epochs) / seconds if seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def split(samples: list[Encoded], eval_fraction: float, seed: int) -> tuple[list[Encoded], list[Encoded]]:
    """(train, eval): a seeded shuffle, `eval_fraction` of it held out (at least one sample when the
    fraction is not 0). Raises SettingsError when either side would be empty."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    num_eval = max(1, round(len(order) * eval_fraction)) if eval_fraction > 0 else 0
    if len(order) - num_eval < 1:
        raise SettingsError(
            f"--eval-fraction: {len(order)} sample(s) leave none to train on after holding out {num_eval} "
            "(give more samples, or --eval-fraction 0)"
        )
    return order[num_eval:], order[:num_eval]


def peft_config(settings: TrainSettings):
    """The peft config of the adapter `settings` describe."""
    from peft import IA3Config, LoraConfig, PromptTuningConfig, PromptTuningInit

    if settings.adapter_type == "lora":
        return LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules or LORA_TARGETS),
            task_type="CAUSAL_LM",
        )
    if settings.adapter_type == "ia3":
        targets = list(settings.target_modules) if settings.target_modules else None
        feedforward = list(settings.feedforward_modules) if settings.feedforward_modules is not None else None
        return IA3Config(target_modules=targets, feedforward_modules=feedforward, task_type="CAUSAL_LM")
    # Rows of real token embeddings are a much better start than noise: the soft prompt begins as
    # (scrambled) text the model can already read.
    return PromptTuningConfig(
        num_virtual_tokens=settings.num_virtual_tokens,
        prompt_tuning_init=PromptTuningInit.SAMPLE_VOCAB,
        task_type="CAUSAL_LM",
    )


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError("--device: CUDA is not available on this machine")
    return device


Progress = Callable[[int, int, float, float], None]  # (step, steps, loss, tokens/s)


@dataclass
class _Optimizer:
    """AdamW over the adapter's parameters, its learning-rate schedule, and gradient clipping."""

    params: list[torch.nn.Parameter]
    adamw: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def step(self, loss: torch.Tensor) -> None:
        self.adamw.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.adamw.step()
        self.scheduler.step()


class Trainer:
    """Trains one adapter on `train`, evaluating on `held_out` after each epoch."""

    def __init__(self, base_dir: Path, settings: TrainSettings, pad_id: int) -> None:
        self.base_dir = base_dir
        self.settings = settings
        self.pad_id = pad_id
        self.device = resolve_device(settings.device)

    def train(
        self,
        train: list[Encoded],
        held_out: list[Encoded],
        out_dir: Path,
        progress: Callable[[int, int], Progress] | None = None,
    ) -> TrainReport:
        """Train, then save the best epoch's adapter to `out_dir` (written whole or not at all; an
        adapter already there is replaced). `progress(epoch, epochs)` gives a callback for that
        epoch's steps."""
        started = time.perf_counter()
        s = self.settings
        torch.manual_seed(s.seed)
        model = self._model()
        params = [p for p in model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
        steps_per_epoch = math.ceil(len(train) / s.batch_size)
        optimizer = _Optimizer(params, adamw, _warmup_then_linear(adamw, steps_per_epoch * s.epochs))
        report = TrainReport(
            adapter_dir=str(out_dir),
            adapter_type=s.adapter_type,
            device=str(self.device),
            train_samples=len(train),
            eval_samples=len(held_out),
            trainable_parameters=sum(p.numel() for p in params),
            learning_rate=s.lr,
        )
        rng = random.Random(s.seed)
        best_loss, best_state, stale = math.inf, None, 0
        for epoch in range(1, s.epochs + 1):
            epoch_started = time.perf_counter()
            callback = progress(epoch, s.epochs) if progress else None
            batches = _batches(train, s.batch_size, rng)
            train_loss, tokens = self._train_epoch(model, optimizer, batches, callback, epoch_started)
            eval_loss = self.evaluate(model, held_out) if held_out else None
            report.epochs.append(
                EpochReport(epoch, train_loss, eval_loss, time.perf_counter() - epoch_started, tokens)
            )
            # Without a held-out split the last epoch is the best one known.
            score = eval_loss if eval_loss is not None else -epoch
            if score < best_loss - 1e-4:
                best_loss, best_state, stale = score, _adapter_state(model), 0
                report.best_epoch = epoch
            else:
                stale += 1
                if stale >= s.patience and epoch < s.epochs:
                    report.stopped_early = True
                    break
        _load_adapter_state(model, best_state)
        _save(model, out_dir)
        report.seconds = time.perf_counter() - started
        return report

    def _train_epoch(
        self,
        model,
        optimizer: _Optimizer,
        batches: list[list[Encoded]],
        callback: Progress | None,
        started: float,
    ) -> tuple[float, int]:
        """One pass over `batches`; returns the mean loss per learned token and the tokens seen."""
        model.train()
        total_loss = total_tokens = total_learned = 0
        for step, batch in enumerate(batches, start=1):
            loss, learned = self._loss(model, batch)
            optimizer.step(loss / learned)
            total_loss += loss.item()
            total_learned += learned
            total_tokens += sum(len(e.input_ids) for e in batch)
            if callback:
                elapsed = time.perf_counter() - started
                callback(step, len(batches), total_loss / total_learned, total_tokens / elapsed)
        return total_loss / total_learned, total_tokens

    @torch.no_grad()
    def evaluate(self, model, samples: list[Encoded]) -> float:
        """Mean loss per learned token over `samples`."""
        model.eval()
        total = learned = 0.0
        for start in range(0, len(samples), self.settings.batch_size):
            loss, n = self._loss(model, samples[start : start + self.settings.batch_size])
            total, learned = total + loss.item(), learned + n
        return total / learned

    def _model(self):
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own bar is the one the user reads

        bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        with warnings.catch_warnings():
            # peft 0.21 calls a transformers method that transformers 5 deprecates; not ours to fix.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            base = AutoModelForCausalLM.from_pretrained(
                self.base_dir, dtype=torch.bfloat16 if bf16 else torch.float32
            ).to(self.device)
            base.config.use_cache = False
            # peft keeps the adapter's own weights in float32 whatever the base model's dtype.
            return get_peft_model(base, peft_config(self.settings))

    def _loss(self, model, batch: list[Encoded]) -> tuple[torch.Tensor, int]:
        """The summed cross-entropy of the batch's learned tokens, and how many there are.

        Rendered samples share a long head (the chat template's system prompt and the opening of the
        user turn): it is run once for the batch and its keys and values repeated for every row, which
        saves about a third of the work on short samples. Gradients flow through the shared head as
        through any other position.
        """
        head = _shared_head(batch)
        if len(batch) < 2 or head < MIN_SHARED_HEAD:
            head = 0
        rows = [e.input_ids[head:] for e in batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        targets = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        start = head + self.settings.reserved_tokens  # where the rows begin in the attention mask
        mask = torch.zeros((len(batch), start + width), dtype=torch.long)
        mask[:, :start] = 1
        for row, e in enumerate(batch):
            n = len(rows[row])
            ids[row, :n] = torch.tensor(rows[row])
            targets[row, : n - 1] = torch.tensor(e.labels[head + 1 :])  # position p predicts token p + 1
            mask[row, start : start + n] = 1
        keep = (targets != IGNORE).any(dim=0).nonzero().squeeze(1)  # [K] positions that predict a label
        targets = targets[:, keep].to(self.device)  # [B, K]
        if head:
            # The wrapper runs the head (a soft prompt's virtual tokens first); the rows continue it
            # on the model the adapter is injected in, so no soft prompt is added twice.
            cache = model(
                input_ids=torch.tensor([batch[0].input_ids[:head]], device=self.device),
                use_cache=True,
                logits_to_keep=1,
            ).past_key_values
            cache.batch_repeat_interleave(len(batch))
            out = model.get_base_model()(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep.to(self.device),
            )
        else:
            out = model(
                input_ids=ids.to(self.device),
                attention_mask=mask[:, self.settings.reserved_tokens :].to(self.device),
                logits_to_keep=(keep + self.settings.reserved_tokens).to(self.device),
            )
        logits = out.logits.float()  # [B, K, V]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
        )
        return loss, int((targets != IGNORE).sum())


def _shared_head(batch: list[Encoded]) -> int:
    """How many leading tokens every sample of the batch shares and learns nothing of (the head stops
    before the position that predicts a sample's first learned token)."""
    first = batch[0].input_ids
    limit = min(next(i for i, label in enumerate(e.labels) if label != IGNORE) for e in batch) - 1
    head = 0
    while head < limit and all(e.input_ids[head] == first[head] for e in batch):
        head += 1
    return head


def _batches(samples: list[Encoded], size: int, rng: random.Random) -> list[list[Encoded]]:
    """Shuffled batches of samples of similar length (less padding): the epoch's order is shuffled,
    sorted by length within windows of 16 batches, cut into batches, and the batches shuffled."""
    order = list(samples)
    rng.shuffle(order)
    window = size * 16
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda e: len(e.input_ids))
        batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
    rng.shuffle(batches)
    return batches


def _warmup_then_linear(optimizer: torch.optim.Optimizer, total_steps: int):
    warmup = max(1, min(50, total_steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _adapter_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _load_adapter_state(model, state: dict[str, torch.Tensor] | None) -> None:
    if state is None:
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name])


def _save(model, out_dir: Path) -> None:
    """Write the adapter next to `out_dir` and rename it into place (replacing an older one only
    then), so a failure leaves nothing new and loses nothing old."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
