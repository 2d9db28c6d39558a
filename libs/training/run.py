"""One training run from samples to a saved adapter: encode every sample as the engine serves it,
hold out the eval split, train. Everything that can be wrong with the data or the settings is found
before the model is loaded, and nothing is written unless training finished."""

from __future__ import annotations

import json
import random
from pathlib import Path

from libs.engine.tokenizer import Tokenizer
from libs.training.data import Sample
from libs.training.render import SampleEncoder
from libs.training.trainer import Trainer, TrainReport, TrainSettings, split

MAX_EXAMPLES = 50  # a manifest holds at most 50 example prompts
_MAX_EXAMPLE_CHARS = 2000


class PreparedRun:
    """Samples encoded and split for one base model; `train` runs it. With `held_out` samples (a
    validation file) those are the held-out split and every sample of `samples` trains."""

    def __init__(
        self,
        base_dir: Path,
        samples: list[Sample],
        settings: TrainSettings,
        held_out: list[Sample] | None = None,
    ) -> None:
        self.base_dir = base_dir
        self.settings = settings
        self.tokenizer = Tokenizer.from_dir(base_dir)
        max_length = settings.max_length or context_length(base_dir)
        encoder = SampleEncoder(self.tokenizer, max_length, settings.reserved_tokens)
        encoded = [encoder.encode(sample) for sample in samples]
        if held_out is None:
            self.train_split, self.eval_split = split(encoded, settings.eval_fraction, settings.seed)
        else:
            self.train_split, _ = split(encoded, 0.0, settings.seed)
            self.eval_split = [encoder.encode(sample) for sample in held_out]
        self.samples = samples

    def train(self, out_dir: Path, progress=None, control=None) -> TrainReport:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id or 0
        trainer = Trainer(self.base_dir, self.settings, pad)
        return trainer.train(self.train_split, self.eval_split, out_dir, progress, control)

    def example_prompts(self, count: int = 32) -> tuple[str, ...]:
        """A seeded sample of the training prompts (first user turns) for the manifest's examples, so
        that routing knows the expert by its data."""
        sources = {e.source for e in self.train_split}
        prompts = list(
            dict.fromkeys(
                s.prompt for s in self.samples if s.source in sources and len(s.prompt) <= _MAX_EXAMPLE_CHARS
            )
        )
        random.Random(self.settings.seed).shuffle(prompts)
        return tuple(prompts[: min(count, MAX_EXAMPLES)])


def context_length(base_dir: Path) -> int:
    config = json.loads((base_dir / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or 2048)
