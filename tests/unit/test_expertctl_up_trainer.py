"""`expertctl up --trainer` (what `make run` runs): the key the trainer signs with, made once and
trusted when none is given, and the banner's lines about it (no new command among them)."""

from __future__ import annotations

from pathlib import Path
from stat import S_IMODE

from libs.experts.signing import Keyring, key_id, load_public_key
from tools.expertctl.up_cmd import how_to_call, signing_key


def test_without_a_key_up_makes_one_beside_the_logs_trusts_it_and_keeps_it(tmp_path):
    trusted = tmp_path / "trusted"
    settings = {"EXPERT_TRUSTED_KEYS": str(trusted)}
    made = Path(signing_key(tmp_path / "logs", settings))
    assert made == (tmp_path / "keys" / "trainer" / "signing.key").resolve()
    assert S_IMODE(made.stat().st_mode) == 0o600
    public = load_public_key(made.with_name("signing.pub"))
    assert [p.name for p in trusted.iterdir()] == [f"{key_id(public)}.pub"]
    assert key_id(public) in Keyring.from_dir(trusted).key_ids

    content = made.read_bytes()
    assert Path(signing_key(tmp_path / "logs", settings)) == made and made.read_bytes() == content
    assert len(list(trusted.iterdir())) == 1


def test_a_given_key_is_used_and_nothing_is_made(tmp_path):
    given = {"EXPERT_TRAINER_SIGNING_KEY": "my/signing.key", "EXPERT_TRUSTED_KEYS": str(tmp_path / "t")}
    assert signing_key(tmp_path / "logs", given) == "my/signing.key"
    assert list(tmp_path.iterdir()) == []


def test_the_banner_names_the_trainers_key_and_adds_no_command():
    common = ("127.0.0.1:50051", "127.0.0.1:50053", {"reception": 9151}, Path("data/logs"))
    without = how_to_call(*common).splitlines()
    with_trainer = how_to_call(*common, trainer="data/keys/trainer/signing.key").splitlines()
    added = [line for line in with_trainer if line not in without]
    assert added and added[0].startswith("Trainer: running")
    assert any("data/keys/trainer/signing.key" in line for line in added)
    # The banner's commands are its lines indented by exactly two spaces: none is added.
    assert not [line for line in added if line.startswith("  ") and not line[2].isspace()]
    assert not [line for line in without if line.startswith("Trainer:")]
