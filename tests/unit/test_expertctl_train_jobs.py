"""`expertctl train` (the API's training jobs) without a stack: its options become the spec's
sections, and what it can tell before any call is refused with status 2. The calls themselves run
against a real stack in tests/e2e/test_training_clients.py."""

from __future__ import annotations

import pytest

from expert_system import InvalidRequest
from expert_system.training import build_spec
from tools.expertctl.main import build_parser, main
from tools.expertctl.training_cmd import _spec_sections


def test_the_options_given_become_the_specs_sections_and_the_rest_is_left_to_the_trainer():
    args = build_parser().parse_args(
        ["train", "submit", "d.jsonl", "--name", "n", "--keywords", "a, b", "--epochs", "2", "--lr", "0.01"]
    )
    sections = _spec_sections(args)
    assert sections == {
        "expert": {"name": "n", "keywords": ["a", "b"]},
        "hyperparameters": {"epochs": 2, "learning_rate": 0.01},
    }
    spec = build_spec("file-x", sections)
    assert spec.hyperparameters.epochs == 2 and not spec.HasField("adapter")


def test_a_section_the_spec_does_not_have_is_refused_naming_it():
    with pytest.raises(InvalidRequest) as refused:
        build_spec("file-x", {"adaptor": {"rank": 4}})
    assert refused.value.field_violations[0][0] == "spec" and "adaptor" in refused.value.message


def test_a_missing_data_file_is_a_usage_error_before_any_call(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    status = main(["train", "submit", str(missing), "--name", "n", "--target", "127.0.0.1:1"])
    assert status == 2
    assert f"DATA.jsonl: {missing} is not a file" in capsys.readouterr().err


def test_submit_needs_a_name():
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "submit", "d.jsonl"])
    assert exit_.value.code == 2
