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

from libs.training.checkpoint import read_checkpoint, restore_rng, rng_state, write_checkpoint
from libs.training.control import Control, StepInfo
from libs.training.render import IGNORE, Encoded
from libs.training.settings import (
    ADAPTABLE_MODULES,
    ADAPTER_TYPES,
    DEFAULT_LEARNING_RATES,
    SettingsError,
    TrainSettings,
)

__all__ = [
    "ADAPTER_TYPES",
    "DEFAULT_LEARNING_RATES",
    "SettingsError",
    "TrainReport",
    "TrainSettings",
    "Trainer",
]

LORA_TARGETS = ADAPTABLE_MODULES  # a LoRA adapter without target_modules adapts every projection
MIN_SHARED_HEAD = 8  # shorter shared heads are not worth a second forward call


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
    steps: int = 0
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


@dataclass
class _RunState:
    """Where a run stands: what a checkpoint records besides tensors (`to_dict`), and the best
    epoch's adapter tensors (`best_state`)."""

    total_steps: int
    step: int = 0  # optimizer steps done
    epoch: int = 1  # the epoch under way
    epoch_step: int = 0  # its steps done
    epoch_loss: float = 0.0  # its summed loss
    epoch_learned: int = 0  # its learned tokens
    epoch_tokens: int = 0  # its tokens
    epoch_seconds: float = 0.0
    epochs: list[dict] = field(default_factory=list)  # EpochReport of each epoch that ended
    best_loss: float = math.inf
    best_epoch: int = 0
    stale: int = 0
    stopped_early: bool = False
    last_eval_loss: float | None = None
    best_state: dict[str, torch.Tensor] | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "best_state"}

    def next_epoch(self) -> None:
        self.epoch += 1
        self.epoch_step = self.epoch_learned = self.epoch_tokens = 0
        self.epoch_loss = self.epoch_seconds = 0.0


@dataclass
class _Steps:
    """What every step of an epoch works with."""

    model: object
    optimizer: _Optimizer
    run: _RunState
    callback: Progress | None
    control: Control


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
        control: Control | None = None,
    ) -> TrainReport:
        """Train, then save the best epoch's adapter to `out_dir` (written whole or not at all; an
        adapter already there is replaced). `progress(epoch, epochs)` gives a callback for that
        epoch's steps; `control` may resume the run from a checkpoint, save checkpoints and stop it
        (TrainingStopped, with nothing written to `out_dir`)."""
        started = time.perf_counter()
        s, control = self.settings, control or Control()
        torch.manual_seed(s.seed)
        model = self._model()
        params = [p for p in model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
        steps_per_epoch = math.ceil(len(train) / s.batch_size)
        total = min(steps_per_epoch * s.epochs, s.max_steps or math.inf)
        optimizer = _Optimizer(params, adamw, _warmup_then_linear(adamw, total))
        run = _RunState(total_steps=total)
        resume = control.resume_from()
        if resume is not None:
            run = self._restore(read_checkpoint(resume), model, optimizer)
        rng = random.Random(s.seed)
        for epoch in range(1, s.epochs + 1):
            batches = _batches(train, s.batch_size, rng)  # drawn every epoch: a resumed run repeats the order
            if epoch < run.epoch:
                continue
            callback = progress(epoch, s.epochs) if progress else None
            steps = _Steps(model, optimizer, run, callback, control)
            self._train_epoch(steps, batches)
            eval_loss = self.evaluate(model, held_out) if held_out else None
            if self._end_epoch(run, model, eval_loss, control):
                break
        _load_adapter_state(model, run.best_state)
        _save(model, out_dir)
        report = TrainReport(
            adapter_dir=str(out_dir),
            adapter_type=s.adapter_type,
            device=str(self.device),
            train_samples=len(train),
            eval_samples=len(held_out),
            trainable_parameters=sum(p.numel() for p in params),
            learning_rate=s.lr,
            epochs=[EpochReport(**e) for e in run.epochs],
            best_epoch=run.best_epoch,
            stopped_early=run.stopped_early,
            steps=run.step,
        )
        report.seconds = time.perf_counter() - started
        return report

    def _end_epoch(self, run: _RunState, model, eval_loss: float | None, control: Control) -> bool:
        """Record the epoch that ended, keep its adapter if it is the best; whether to stop."""
        train_loss = run.epoch_loss / max(1, run.epoch_learned)
        run.epochs.append(
            asdict(EpochReport(run.epoch, train_loss, eval_loss, run.epoch_seconds, run.epoch_tokens))
        )
        control.after_epoch(run.epoch, train_loss, eval_loss)
        # Without a held-out split the last epoch is the best one known.
        score = eval_loss if eval_loss is not None else -run.epoch
        if score < run.best_loss - 1e-4:
            run.best_loss, run.best_state, run.best_epoch = score, _adapter_state(model), run.epoch
            run.stale = 0
        else:
            run.stale += 1
            run.stopped_early = run.stale >= self.settings.patience and run.epoch < self.settings.epochs
        run.last_eval_loss = eval_loss
        run.next_epoch()
        return run.stopped_early or run.step >= run.total_steps

    def _train_epoch(self, steps: _Steps, batches: list[list[Encoded]]) -> None:
        """The epoch's batches from where the run stands in it (a resumed run skips those done)."""
        steps.model.train()
        run, s = steps.run, self.settings
        seconds_before, resumed_at = run.epoch_seconds, time.perf_counter()
        for batch in batches[run.epoch_step :]:
            if run.step >= run.total_steps:
                break
            loss, learned = self._loss(steps.model, batch)
            steps.optimizer.step(loss / learned)
            run.step, run.epoch_step = run.step + 1, run.epoch_step + 1
            run.epoch_loss += loss.item()
            run.epoch_learned += learned
            run.epoch_tokens += sum(len(e.input_ids) for e in batch)
            run.epoch_seconds = seconds_before + time.perf_counter() - resumed_at
            mean, speed = run.epoch_loss / run.epoch_learned, run.epoch_tokens / run.epoch_seconds
            if steps.callback:
                steps.callback(run.epoch_step, len(batches), mean, speed)
            info = StepInfo(run.step, run.total_steps, run.epoch, s.epochs, mean, speed, run.last_eval_loss)
            steps.control.after_step(info, lambda directory: self._checkpoint(directory, steps))

    def _checkpoint(self, directory: Path, steps: _Steps) -> None:
        state = {
            "run": steps.run.to_dict(),
            "adapter": _adapter_state(steps.model),
            "best": steps.run.best_state,
            "optimizer": steps.optimizer.adamw.state_dict(),
            "scheduler": steps.optimizer.scheduler.state_dict(),
            "rng": rng_state(self.device),
        }
        write_checkpoint(directory, steps.model, state)

    def _restore(self, state: dict, model, optimizer: _Optimizer) -> _RunState:
        """The run as the checkpoint left it: adapter, optimizer, schedule, RNG and counters."""
        _load_adapter_state(model, state["adapter"])
        optimizer.adamw.load_state_dict(state["optimizer"])
        optimizer.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"], self.device)
        run = _RunState(**state["run"])
        run.best_state = state["best"]
        return run

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
