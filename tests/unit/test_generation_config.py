"""The sampling a checkpoint recommends (generation_config.json), as the engine reads and reports it."""

from __future__ import annotations

import json

import pytest

from libs.engine.models.errors import CheckpointError
from libs.engine.models.generation_config import sampling_defaults


def write(tmp_path, **values) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))


def test_only_the_sampling_values_the_file_sets_are_read(tmp_path):
    assert sampling_defaults(tmp_path) == {}  # no file
    write(tmp_path, temperature=0.7, top_p=0.8, do_sample=True, max_new_tokens=100)
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8}
    write(tmp_path, top_k=20, repetition_penalty=1.05, temperature=0)
    assert sampling_defaults(tmp_path) == {"top_k": 20, "repetition_penalty": 1.05, "temperature": 0.0}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -1}, "temperature out of range"),
        ({"top_p": 0}, "top_p out of range"),
        ({"top_p": 1.5}, "top_p out of range"),
        ({"top_k": 2.5}, "top_k out of range"),
        ({"repetition_penalty": 0}, "repetition_penalty out of range"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": True}, "top_k must be a number"),
    ],
)
def test_a_broken_value_is_an_error_naming_the_file_and_field(tmp_path, values, message):
    write(tmp_path, **values)
    with pytest.raises(CheckpointError, match=message) as raised:
        sampling_defaults(tmp_path)
    assert "generation_config.json" in str(raised.value)


def test_a_file_that_is_not_a_json_object_is_an_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        sampling_defaults(tmp_path)
