"""The expert manifest: every validation rule names its field; canonical JSON round trips; the base
model identity is computed from an HF config and mismatches name the differing field."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pytest

from libs.experts.manifest import BaseModelIdentity, Manifest, ManifestError

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
BASE = BaseModelIdentity.from_hf_config(LLAMA_CONFIG)


def lora(**overrides) -> Manifest:
    fields = {
        "name": "sql-helper",
        "version": "1.2.3",
        "description": "Writes and explains SQL queries.",
        "adapter_type": "lora",
        "base_model": BASE,
        "target_modules": ("q_proj", "v_proj"),
        "rank": 8,
        "alpha": 16.0,
    } | overrides
    return Manifest(**fields)


def ia3(**overrides) -> Manifest:
    defaults = {"adapter_type": "ia3", "rank": None, "alpha": None, "target_modules": ("k_proj", "down_proj")}
    return lora(**(defaults | overrides))


def soft_prompt(**overrides) -> Manifest:
    defaults = {"adapter_type": "soft_prompt", "rank": None, "alpha": None, "target_modules": ()}
    return lora(**(defaults | {"num_virtual_tokens": 5} | overrides))


def refused(make, **overrides) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        make(**overrides)
    assert str(info.value).startswith(f"{info.value.field}: ")
    return info.value


# -- construction -----------------------------------------------------------------------------------


def test_a_valid_manifest_of_each_adapter_type_is_accepted():
    assert lora().rank == 8 and ia3().rank is None and soft_prompt().num_virtual_tokens == 5


def test_lists_become_tuples_and_alpha_a_float():
    manifest = lora(keywords=["sql", "db"], alpha=16)
    assert manifest.keywords == ("sql", "db") and isinstance(manifest.alpha, float)


def test_the_error_message_starts_with_the_field_and_names_the_pattern():
    error = refused(lora, name="../x")
    assert error.field == "manifest.name"
    assert str(error) == "manifest.name: '../x' does not match [a-z0-9][a-z0-9-]{1,63}"


@pytest.mark.parametrize("name", ["../x", "a", "-ab", "Sql", "sql_helper", "a" * 65, "ab ", "", None])
def test_names_outside_the_pattern_are_refused(name):
    assert refused(lora, name=name).field == "manifest.name"


@pytest.mark.parametrize("name", ["ab", "sql-helper", "0day", "a" * 64])
def test_names_inside_the_pattern_are_accepted(name):
    assert lora(name=name).name == name


@pytest.mark.parametrize(
    "version", ["1.0.0", "0.0.1", "1.2.3-alpha.1", "1.0.0-rc.1+build.5", "2.0.0+20240101"]
)
def test_semver_versions_are_accepted(version):
    assert lora(version=version).version == version


@pytest.mark.parametrize("version", ["1.0", "v1.0.0", "01.0.0", "1.0.0-", "1.0.0-01", "1.0.0+", "1.0.0.0", 1])
def test_versions_that_are_not_semver_are_refused(version):
    assert refused(lora, version=version).field == "manifest.version"


@pytest.mark.parametrize("description", ["", "   ", "x" * 2001, None])
def test_descriptions_must_be_non_empty_and_at_most_2000_characters(description):
    assert refused(lora, description=description).field == "manifest.description"


def test_a_2000_character_description_is_accepted():
    assert len(lora(description="x" * 2000).description) == 2000


def test_unknown_adapter_types_are_refused():
    assert refused(lora, adapter_type="dora").field == "manifest.adapter_type"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rank": 0}, "manifest.rank"),
        ({"rank": None}, "manifest.rank"),
        ({"rank": True}, "manifest.rank"),
        ({"rank": 8.0}, "manifest.rank"),
        ({"alpha": 0}, "manifest.alpha"),
        ({"alpha": -1.0}, "manifest.alpha"),
        ({"alpha": math.nan}, "manifest.alpha"),
        ({"alpha": math.inf}, "manifest.alpha"),
        ({"alpha": None}, "manifest.alpha"),
        ({"target_modules": ()}, "manifest.target_modules"),
        ({"target_modules": ("q.proj",)}, "manifest.target_modules[0]"),
        ({"target_modules": ("q_proj", "")}, "manifest.target_modules[1]"),
        ({"target_modules": ("q_proj", "q_proj")}, "manifest.target_modules"),
        ({"target_modules": "q_proj"}, "manifest.target_modules"),
        ({"num_virtual_tokens": 5}, "manifest.num_virtual_tokens"),
        ({"feedforward_modules": ("v_proj",)}, "manifest.feedforward_modules"),
    ],
)
def test_lora_fields_are_validated(overrides, field):
    assert refused(lora, **overrides).field == field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"target_modules": ()}, "manifest.target_modules"),
        ({"rank": 8}, "manifest.rank"),
        ({"alpha": 16.0}, "manifest.alpha"),
        ({"use_rslora": True}, "manifest.use_rslora"),
        ({"feedforward_modules": ("up_proj",)}, "manifest.feedforward_modules"),
    ],
)
def test_ia3_fields_are_validated(overrides, field):
    assert refused(ia3, **overrides).field == field


def test_ia3_feedforward_modules_within_the_targets_are_accepted():
    assert ia3(feedforward_modules=("down_proj",)).feedforward_modules == ("down_proj",)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_virtual_tokens": None}, "manifest.num_virtual_tokens"),
        ({"num_virtual_tokens": 0}, "manifest.num_virtual_tokens"),
        ({"target_modules": ("q_proj",)}, "manifest.target_modules"),
    ],
)
def test_soft_prompt_fields_are_validated(overrides, field):
    assert refused(soft_prompt, **overrides).field == field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"keywords": ("sql", "")}, "manifest.keywords[1]"),
        ({"keywords": tuple(f"k{i}" for i in range(101))}, "manifest.keywords"),
        ({"keywords": ("sql", "sql")}, "manifest.keywords"),
        ({"examples": ("  ",)}, "manifest.examples[0]"),
        ({"examples": tuple(f"example {i}" for i in range(51))}, "manifest.examples"),
        ({"capabilities": (3,)}, "manifest.capabilities[0]"),
        ({"task_types": ("",)}, "manifest.task_types[0]"),
        ({"incompatible_with": ("../y",)}, "manifest.incompatible_with[0]"),
        ({"incompatible_with": ("other", "sql-helper")}, "manifest.incompatible_with[1]"),
        ({"priority": 1001}, "manifest.priority"),
        ({"priority": -1001}, "manifest.priority"),
        ({"priority": 1.5}, "manifest.priority"),
        ({"priority": True}, "manifest.priority"),
        ({"author": 7}, "manifest.author"),
        ({"format_version": 2}, "manifest.format_version"),
    ],
)
def test_router_metadata_is_validated(overrides, field):
    assert refused(lora, **overrides).field == field


def test_the_limits_themselves_are_accepted():
    manifest = lora(
        keywords=tuple(f"k{i}" for i in range(100)),
        examples=tuple(f"example {i}" for i in range(50)),
        priority=-1000,
        incompatible_with=("other-expert",),
    )
    assert len(manifest.keywords) == 100 and len(manifest.examples) == 50


def test_a_base_model_that_is_not_an_identity_is_refused():
    assert refused(lora, base_model=BASE.to_dict()).field == "manifest.base_model"


# -- JSON -------------------------------------------------------------------------------------------


def test_json_round_trips_every_field():
    manifest = ia3(
        feedforward_modules=("down_proj",),
        capabilities=("sql",),
        keywords=("select", "join"),
        examples=("How do I join two tables?",),
        task_types=("code_generation",),
        priority=5,
        incompatible_with=("json-parser",),
        author="Data team",
    )
    assert Manifest.from_json_bytes(manifest.to_json_bytes()) == manifest


def test_json_is_canonical():
    data = lora(description="Écrit du SQL.").to_json_bytes()
    raw = json.loads(data)
    assert data == (json.dumps(raw, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()
    assert "Écrit".encode() in data and data.endswith(b"}\n")


def test_equal_manifests_have_equal_bytes():
    assert lora(alpha=16).to_json_bytes() == lora(alpha=16.0).to_json_bytes()


def json_with(**changes) -> bytes:
    raw = lora().to_dict() | changes
    return json.dumps(raw).encode()


def from_json_refused(data: bytes) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        Manifest.from_json_bytes(data)
    return info.value


def test_unknown_keys_are_refused_by_name():
    error = from_json_refused(json_with(colour="blue", size=3))
    assert error.field == "manifest" and "'colour'" in str(error) and "'size'" in str(error)


def test_a_newer_format_version_is_refused_before_its_unknown_keys():
    assert from_json_refused(json_with(format_version=2, new_field=1)).field == "manifest.format_version"


def test_missing_required_keys_are_refused_by_name():
    raw = lora().to_dict()
    del raw["description"]
    assert from_json_refused(json.dumps(raw).encode()).field == "manifest.description"


def test_optional_keys_may_be_left_out():
    raw = lora().to_dict()
    for key in ("keywords", "examples", "priority", "author", "format_version"):
        del raw[key]
    assert Manifest.from_json_bytes(json.dumps(raw).encode()) == lora()


def test_validation_applies_to_json_too():
    assert from_json_refused(json_with(name="../x")).field == "manifest.name"
    assert from_json_refused(json_with(keywords="sql")).field == "manifest.keywords"


def test_base_model_errors_name_the_nested_field():
    base = BASE.to_dict() | {"vocab_size": 0}
    assert from_json_refused(json_with(base_model=base)).field == "manifest.base_model.vocab_size"


@pytest.mark.parametrize(
    "data",
    [b"\xff\xfe", b"{", b"[]", b'{"name": "ab", "name": "cd"}', b'{"alpha": NaN}'],
    ids=["not-utf8", "not-json", "not-object", "duplicate-key", "nan"],
)
def test_malformed_json_is_refused(data):
    assert from_json_refused(data).field == "manifest"


# -- base model identity ----------------------------------------------------------------------------


def test_the_identity_keeps_the_readable_fields():
    assert (BASE.architecture, BASE.hidden_size, BASE.num_layers, BASE.vocab_size) == (
        "LlamaForCausalLM",
        64,
        2,
        384,
    )


def test_the_config_hash_is_the_sha256_of_the_deciding_fields_as_canonical_json():
    deciding = {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
    }
    canonical = json.dumps(deciding, sort_keys=True, separators=(",", ":")).encode()
    assert BASE.config_hash == hashlib.sha256(canonical).hexdigest()


def test_absent_fields_take_hf_defaults():
    explicit = LLAMA_CONFIG | {"num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": False}
    implicit = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("num_key_value_heads", "head_dim")}
    del implicit["tie_word_embeddings"]
    assert BaseModelIdentity.from_hf_config(implicit) == BaseModelIdentity.from_hf_config(explicit)


def test_fields_that_do_not_shape_adapters_do_not_change_the_identity():
    assert BaseModelIdentity.from_hf_config(LLAMA_CONFIG | {"rope_theta": 1e6, "rms_norm_eps": 1e-5}) == BASE


@pytest.mark.parametrize(
    "change", [{"intermediate_size": 256}, {"num_key_value_heads": 4}, {"tie_word_embeddings": True}]
)
def test_hidden_deciding_fields_change_the_config_hash(change):
    assert BaseModelIdentity.from_hf_config(LLAMA_CONFIG | change).config_hash != BASE.config_hash


def test_mismatch_names_the_first_differing_field():
    model = BaseModelIdentity.from_hf_config(LLAMA_CONFIG | {"vocab_size": 49152})
    package = BaseModelIdentity.from_hf_config(LLAMA_CONFIG | {"vocab_size": 32000})
    assert package.mismatch(model) == "vocab_size: package 32000, model 49152"


def test_mismatch_of_hidden_fields_names_the_config_hash():
    other = BaseModelIdentity.from_hf_config(LLAMA_CONFIG | {"intermediate_size": 256})
    assert BASE.mismatch(other).startswith("config_hash: ")


def test_equal_identities_have_no_mismatch():
    assert BASE.mismatch(BaseModelIdentity.from_hf_config(dict(LLAMA_CONFIG))) is None


def test_the_identity_round_trips_through_a_dict():
    assert BaseModelIdentity.from_dict(BASE.to_dict()) == BASE


def test_the_identity_of_a_checkpoint_directory_reads_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    assert BaseModelIdentity.from_dir(tmp_path) == BASE


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ManifestError, match=r"config\.json does not exist"):
        BaseModelIdentity.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"architectures": []}, "config.architectures"),
        ({"intermediate_size": None}, "config.intermediate_size"),
        ({"hidden_size": "64"}, "config.hidden_size"),
        ({"tie_word_embeddings": "yes"}, "config.tie_word_embeddings"),
    ],
)
def test_configs_without_the_deciding_fields_are_refused_by_name(change, field):
    with pytest.raises(ManifestError) as info:
        BaseModelIdentity.from_hf_config(LLAMA_CONFIG | change)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": 0}, "base_model.hidden_size"),
        ({"config_hash": "abc"}, "base_model.config_hash"),
        ({"architecture": ""}, "base_model.architecture"),
    ],
)
def test_identity_fields_are_validated(change, field):
    with pytest.raises(ManifestError) as info:
        dataclasses.replace(BASE, **change)
    assert info.value.field == field
