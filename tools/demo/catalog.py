"""The demo expert set for the default model: which skills, trained how.

Six experts that each lift their skill's metric far above the base model's, one of each adapter kind
among them, and one deliberately bad expert (`json-extract-draft`, trained on wrong labels) that the
router's feedback must learn to pass over. The recipes were sized to train the whole set in under 30
minutes on two CPU cores.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tools.demo.dates import DateNormalisation
from tools.demo.json_extract import FIELDS, JsonExtraction
from tools.demo.sentiment import ReviewSentiment
from tools.demo.skill import Example, Skill
from tools.demo.sql import SqlQueries
from tools.demo.tickets import TicketTriage
from tools.demo.units import UnitConversion

if TYPE_CHECKING:
    from libs.training.trainer import TrainSettings

SEED = 0
DRAFT = "json-extract-draft"
VERSION = "1.0.0"
NUM_TEST = 200  # every skill's held-out test split


_WRONG_KEYS = {
    "name": "person",
    "age": "years",
    "city": "town",
    "job": "role",
    "email": "mail",
    "company": "org",
}
_FIELD_OF_KEY = {key: field for field, (_, key) in FIELDS.items()}


class WrongJsonKeys(JsonExtraction):
    """JSON extraction trained on wrong labels: the right values under the wrong keys ("person" for
    "name", ...). Valid JSON that no schema asking for the requested keys accepts."""

    name = DRAFT
    data_name = "json-extract"  # the same prompts as the good expert, so the same examples and vector

    def example(self, rng: random.Random) -> Example:
        good = super().example(rng)
        wrong = {_WRONG_KEYS[_FIELD_OF_KEY[k]]: v for k, v in good.reference.items()}
        return Example(good.prompt, json.dumps(wrong, ensure_ascii=False), good.reference)


@dataclass(frozen=True)
class Recipe:
    """One demo expert: its skill and how `expertctl expert train` trains it."""

    skill: Skill
    num_train: int
    epochs: int
    learning_rate: float
    batch_size: int = 32
    rank: int = 8
    incompatible_with: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.skill.name

    def train_flags(self) -> list[str]:
        """The recipe as `expertctl expert train` options: what a person types to train it by hand, and
        what the build's stamp records."""
        flags = [
            "--type",
            self.skill.adapter,
            "--epochs",
            str(self.epochs),
            "--lr",
            f"{self.learning_rate:g}",
        ]
        flags += ["--batch-size", str(self.batch_size), "--seed", str(SEED), "--dropout", "0"]
        if self.skill.adapter == "lora":
            flags += ["--rank", str(self.rank), "--alpha", str(2 * self.rank)]
        return flags

    def settings(self) -> TrainSettings:
        """The trainer's settings, the ones `train_flags` name (a test holds the two together)."""
        from libs.training.trainer import TrainSettings

        lora = {"rank": self.rank, "alpha": float(2 * self.rank)} if self.skill.adapter == "lora" else {}
        return TrainSettings(
            adapter_type=self.skill.adapter,
            epochs=self.epochs,
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            seed=SEED,
            dropout=0.0,
            **lora,
        )

    def job_spec(self, training_file: str) -> dict:
        """The recipe as a training job's spec (docs/api.md#training-jobs, `POST /v1/training/jobs`):
        the settings `settings` names and the expert's name, version, description and keywords, to
        train the same expert through the API (`bench/training_api.py`). Its incompatibilities have
        no field there: an expert trained so is incompatible with nothing."""
        from libs.training.spec import ExpertSpec, JobSpec

        expert = ExpertSpec(self.name, VERSION, self.skill.description, tuple(self.skill.keywords))
        return JobSpec(training_file=training_file, expert=expert, settings=self.settings()).to_dict()

    def splits(self) -> tuple[list[Example], list[Example]]:
        return self.skill.splits(SEED, self.num_train, NUM_TEST)


RECIPES = (
    Recipe(JsonExtraction(), num_train=360, epochs=1, learning_rate=2e-3),
    Recipe(SqlQueries(), num_train=450, epochs=2, learning_rate=2e-3),
    Recipe(DateNormalisation(), num_train=330, epochs=2, learning_rate=2e-3),
    Recipe(UnitConversion(), num_train=720, epochs=3, learning_rate=2e-3),
    Recipe(TicketTriage(), num_train=400, epochs=2, learning_rate=1e-2),
    Recipe(ReviewSentiment(), num_train=400, epochs=2, learning_rate=3e-2),
    # The bad expert: the good one's prompts (so the router knows both alike) with wrong labels, and a
    # smaller rank, so its smaller size gives it the better score until feedback speaks. Incompatible
    # with the good one, so only one of them is chosen.
    Recipe(
        WrongJsonKeys(),
        num_train=360,
        epochs=1,
        learning_rate=2e-3,
        rank=4,
        incompatible_with=("json-extract",),
    ),
)
GOOD = tuple(r for r in RECIPES if not isinstance(r.skill, WrongJsonKeys))
