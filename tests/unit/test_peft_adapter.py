"""Reading adapters as `peft` saves them: the three kinds the engine applies, and a refusal naming
the field for everything else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from libs.experts.peft_adapter import PackageError, read_peft_adapter
from tests.helpers.peft_adapters import LORA_TARGETS, write_all_adapters, write_lora_adapter


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    return write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))


def edited(source: Path, destination: Path, **changes) -> Path:
    """A copy of the adapter directory `source` whose config has `changes` applied."""
    shutil.copytree(source, destination)
    config = json.loads((destination / "adapter_config.json").read_text())
    (destination / "adapter_config.json").write_text(json.dumps(config | changes))
    return destination


def refusal(path: Path) -> str:
    with pytest.raises(PackageError) as info:
        read_peft_adapter(path)
    return str(info.value)


def test_a_lora_is_read_with_its_settings(adapters):
    adapter = read_peft_adapter(adapters["lora"])
    assert adapter.adapter_type == "lora" and adapter.config["peft_type"] == "LORA"
    assert adapter.target_modules == tuple(sorted(LORA_TARGETS))
    assert (adapter.rank, adapter.alpha, adapter.use_rslora) == (8, 16.0, False)
    assert adapter.weights == (adapters["lora"] / "adapter_model.safetensors").read_bytes()


def test_an_ia3_adapter_is_read_with_its_feedforward_modules(adapters):
    adapter = read_peft_adapter(adapters["ia3"])
    assert adapter.adapter_type == "ia3" and adapter.rank is None and adapter.alpha is None
    assert adapter.target_modules == ("down_proj", "k_proj", "v_proj")
    assert adapter.feedforward_modules == ("down_proj",)


def test_a_prompt_tuning_adapter_is_read_as_a_soft_prompt(adapters):
    adapter = read_peft_adapter(adapters["soft_prompt"])
    assert adapter.adapter_type == "soft_prompt" and adapter.num_virtual_tokens == 5
    assert adapter.target_modules == ()


def test_an_rslora_is_read_as_such(tiny_llama, tmp_path):
    adapter = read_peft_adapter(write_lora_adapter(tiny_llama, tmp_path / "rs", r=4, use_rslora=True))
    assert adapter.use_rslora and adapter.rank == 4


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"peft_type": "LOHA"}, "adapter_config.json: peft_type: 'LOHA' is not supported"),
        ({"use_dora": True}, "adapter_config.json: use_dora:"),
        ({"bias": "all"}, "adapter_config.json: bias:"),
        ({"fan_in_fan_out": True}, "adapter_config.json: fan_in_fan_out:"),
        ({"modules_to_save": ["lm_head"]}, "adapter_config.json: modules_to_save:"),
        ({"layers_to_transform": [0]}, "adapter_config.json: layers_to_transform:"),
        ({"rank_pattern": {"q_proj": 4}}, "adapter_config.json: rank_pattern:"),
        ({"alpha_pattern": {"q_proj": 4}}, "adapter_config.json: alpha_pattern:"),
        ({"lora_bias": True}, "adapter_config.json: lora_bias:"),
        ({"target_modules": ".*proj"}, "adapter_config.json: target_modules: a pattern"),
        ({"target_modules": ["self_attn.q_proj"]}, "adapter_config.json: target_modules:"),
        ({"r": 0}, "adapter_config.json: r:"),
        ({"lora_alpha": -1}, "adapter_config.json: lora_alpha:"),
        ({"task_type": "SEQ_CLS"}, "adapter_config.json: task_type:"),
        ({"r": 4}, "does not have rank 4"),
        ({"target_modules": ["q_proj"]}, "module 'down_proj' is not in target_modules"),
    ],
)
def test_lora_configs_the_engine_cannot_apply_are_refused_by_field(adapters, tmp_path, changes, message):
    assert message in refusal(edited(adapters["lora"], tmp_path / "a", **changes))


def test_ia3_fan_in_fan_out_is_refused(adapters, tmp_path):
    assert "fan_in_fan_out" in refusal(edited(adapters["ia3"], tmp_path / "a", fan_in_fan_out=True))


def test_ia3_feedforward_modules_outside_the_targets_are_refused(adapters, tmp_path):
    changed = edited(adapters["ia3"], tmp_path / "a", feedforward_modules=["up_proj"])
    assert "feedforward_modules: must be a subset" in refusal(changed)


def test_prompt_tuning_for_encoder_decoders_is_refused(adapters, tmp_path):
    changed = edited(adapters["soft_prompt"], tmp_path / "a", num_transformer_submodules=2)
    assert "adapter_config.json: num_transformer_submodules:" in refusal(changed)


def test_a_pickled_adapter_is_refused(adapters, tmp_path):
    shutil.copytree(adapters["lora"], tmp_path / "a")
    (tmp_path / "a" / "adapter_model.safetensors").rename(tmp_path / "a" / "adapter_model.bin")
    assert "adapter_model.bin is a pickle, which is not accepted" in refusal(tmp_path / "a")


def test_missing_files_are_named(adapters, tmp_path):
    shutil.copytree(adapters["lora"], tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").unlink()
    assert refusal(tmp_path / "a").startswith("adapter_config.json: missing")
    assert refusal(tmp_path / "absent").endswith("not a PEFT adapter directory")


def test_a_broken_safetensors_file_is_refused(adapters, tmp_path):
    shutil.copytree(adapters["lora"], tmp_path / "a")
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert "adapter_model.safetensors: invalid safetensors header" in refusal(tmp_path / "a")
