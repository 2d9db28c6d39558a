"""OpenAI's fine-tuning request read into the training job spec (services/reception/http/
fine_tuning_request.py): what each field becomes, and every field a job cannot honour refused by its
OpenAI name. The spec it makes is checked by the real parse_spec, as the admission does."""

from __future__ import annotations

import pytest

from libs.errors import ServiceError
from libs.training.spec import parse_spec
from services.reception.http.fine_tuning_request import openai_names, to_job_spec

BASE = {"model": "tiny", "training_file": "file-abc"}


def refused(body) -> list[str]:
    with pytest.raises(ServiceError) as error:
        to_job_spec(body)
    return [field for field, _ in error.value.violations]


def test_the_openai_fields_become_the_spec_the_admission_reads():
    spec = to_job_spec(
        {
            **BASE,
            "suffix": "shout",
            "seed": 5,
            "validation_file": "file-val",
            "method": {
                "type": "supervised",
                "supervised": {
                    "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 2}
                },
            },
        }
    )
    parsed = parse_spec(spec)
    assert parsed.base_model == "tiny" and parsed.validation_file == "file-val"
    assert parsed.expert.name == "shout" and parsed.settings.adapter_type == "lora"
    s = parsed.settings
    assert (s.epochs, s.batch_size, s.seed, s.lr) == (2, 4, 5, pytest.approx(2e-3))


def test_auto_and_absent_hyperparameters_keep_the_defaults_and_a_name_is_made():
    spec = to_job_spec({**BASE, "hyperparameters": {"n_epochs": "auto", "batch_size": "auto"}})
    assert spec["hyperparameters"] == {}
    assert parse_spec(spec).expert.name.startswith("ft-")


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({**BASE, "method": {"type": "dpo"}}, ["method.type"]),
        (
            {**BASE, "method": {"type": "reinforcement", "reinforcement": {}}},
            ["method.type", "method.reinforcement"],
        ),
        ({**BASE, "integrations": [{"type": "wandb"}]}, ["integrations"]),
        ({**BASE, "metadata": {"a": "b"}}, ["metadata"]),
        (
            {**BASE, "hyperparameters": {"n_epochs": 0, "learning_rate_multiplier": -1}},
            [
                "hyperparameters.n_epochs",
                "hyperparameters.learning_rate_multiplier",
            ],
        ),
        (
            {**BASE, "hyperparameters": {}, "method": {"supervised": {"hyperparameters": {}}}},
            ["hyperparameters"],
        ),
        ({**BASE, "suffix": "Bad Name", "seed": -1, "stream": True}, ["stream", "suffix", "seed"]),
        ({"training_file": 3}, ["model", "training_file"]),
    ],
)
def test_what_a_job_cannot_honour_is_refused_naming_each_field(body, fields):
    assert refused(body) == fields


def test_a_body_that_is_no_object_is_refused():
    assert refused(["model"]) == ["body"]


@pytest.mark.parametrize("multiplier", [1e300, 10**400, 10.5, float("nan"), float("inf")])
def test_a_learning_rate_multiplier_past_its_ceiling_is_refused_by_its_openai_name(multiplier):
    body = {**BASE, "hyperparameters": {"learning_rate_multiplier": multiplier}}
    assert refused(body) == ["hyperparameters.learning_rate_multiplier"]


def test_a_refusal_of_the_admission_names_the_hyperparameter_where_the_request_gave_it():
    nested = {**BASE, "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 99}}}}
    assert openai_names(nested)["hyperparameters.epochs"] == "method.supervised.hyperparameters.n_epochs"
    assert (
        openai_names(nested)["hyperparameters.batch_size"] == "method.supervised.hyperparameters.batch_size"
    )
    top = {**BASE, "hyperparameters": {"n_epochs": 99}}
    assert openai_names(top)["hyperparameters.epochs"] == "hyperparameters.n_epochs"
    assert openai_names(["not", "a", "body"])["base_model"] == "model"
