"""Loading checkpoints: clear errors for broken ones, sharded and tied checkpoints, and RoPE scaling
types that match transformers (the external reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.engine import LLMEngine, SamplingParams
from libs.engine.models.errors import CheckpointError
from libs.engine.tokenizer import TokenizerError
from tests.helpers.reference import capture_logits, hf_greedy, load_hf
from tests.helpers.tiny_checkpoint import write_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_config(path: Path, **changes) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    file.write_text(json.dumps(config))


def load(path: Path, **overrides) -> LLMEngine:
    return LLMEngine.from_pretrained(str(path), **({"max_model_len": 256, "num_blocks": 64} | overrides))


def long_prompts(vocab: int, lengths=(100, 150)) -> list[list[int]]:
    """Prompts past 64 positions, where the RoPE scalings below start to matter."""
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_matches_transformers(path: Path, prompts: list[list[int]], new_tokens: int = 32) -> None:
    """Greedy tokens identical to transformers', last-position logits after prefill within 1e-3."""
    engine = load(path)
    hf_model = load_hf(path)
    captured = capture_logits(engine)
    for prompt in prompts:
        captured.clear()
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        out = engine.generate([prompt], params)[0]
        expected_tokens, expected_logits = hf_greedy(hf_model, prompt, new_tokens)
        assert out.token_ids == expected_tokens
        diff = (captured[0][0] - expected_logits[0]).abs().max().item()
        assert diff <= 1e-3, f"max |logit difference| after prefill: {diff}"


# -- broken checkpoints ---------------------------------------------------------------------------


def test_a_missing_config_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load(path)


def test_a_config_that_is_not_json_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load(path)


def test_an_unknown_architecture_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    edit_config(path, architectures=["MambaForCausalLM"])
    with pytest.raises(CheckpointError, match=r"architecture 'MambaForCausalLM' is not supported"):
        load(path)


def test_a_missing_config_field_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    edit_config(path, hidden_size=None)
    with pytest.raises(CheckpointError, match=r"field 'hidden_size' is missing"):
        load(path)


def test_a_missing_tensor_is_named(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load(path)


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    edit_config(path, intermediate_size=96)
    with pytest.raises(CheckpointError) as info:
        load(path)
    message = str(info.value)
    assert "model.layers.0.mlp.gate_proj.weight" in message
    assert "(128, 64)" in message and "(96, 64)" in message


def test_a_checkpoint_without_safetensors_files_is_refused(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weight files"):
        load(path)


def test_a_missing_tokenizer_is_a_tokenizer_error_naming_the_file(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    (path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        load(path)


def test_an_unsupported_rope_type_is_refused_naming_it(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match=r"rope scaling type 'dynamic' is not supported"):
        load(path)


def test_a_rope_type_without_its_fields_is_refused_naming_the_field(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    edit_config(path, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match=r"'llama3' needs field 'low_freq_factor'"):
        load(path)


# -- sharded and tied checkpoints -----------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama saved again by transformers in ~20 KB shards with an index."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(path, max_shard_size="20KB")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_llama / name, path / name)
    return path


def test_a_sharded_checkpoint_has_an_index_and_several_files(sharded):
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert not (sharded / "model.safetensors").exists()


def test_a_sharded_checkpoint_matches_the_unsharded_one_token_for_token(sharded, tiny_llama):
    prompts = ["Hello", "def add(a, b):", [5, 6, 7, 8, 9]]
    params = [GREEDY, SamplingParams(temperature=0.9, seed=4, max_tokens=32, ignore_eos=True), GREEDY]
    expected = [out.token_ids for out in load(tiny_llama).generate(prompts, params)]
    assert [out.token_ids for out in load(sharded).generate(prompts, params)] == expected


def test_a_shard_listed_in_the_index_but_missing_is_named(sharded, tmp_path):
    path = copy_checkpoint(sharded, tmp_path / "ckpt")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (path / victim).unlink()
    with pytest.raises(
        CheckpointError, match=rf"{victim}: missing \(listed in model.safetensors.index.json\)"
    ):
        load(path)


def test_tied_embeddings_match_transformers(tmp_path):
    path = write_checkpoint(tmp_path / "tied", "llama", seed=7, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    engine = load(path)
    assert engine.model_config.tie_word_embeddings
    assert engine.model.embed_tokens is None  # tokens are looked up in the head's weight: held once
    assert_matches_transformers(path, long_prompts(engine.model_config.vocab_size, lengths=(7, 40)))


# -- RoPE scaling ---------------------------------------------------------------------------------

ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("rope_type", list(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(tmp_path, rope_type):
    rope = {**ROPE_SCALINGS[rope_type], "rope_theta": 10000.0}
    path = write_checkpoint(tmp_path / rope_type, "llama", seed=3, rope_parameters=rope)
    engine = load(path)
    assert engine.model_config.rope["rope_type"] == rope_type
    assert_matches_transformers(path, long_prompts(engine.model_config.vocab_size))


def test_rope_scaling_changes_the_outputs_past_the_original_length(tiny_llama, tmp_path):
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    edit_config(path, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    prompt = long_prompts(384, lengths=(100,))[0]
    scaled = load(path).generate([prompt], GREEDY)[0]
    assert scaled.token_ids != load(tiny_llama).generate([prompt], GREEDY)[0].token_ids


def test_the_old_rope_scaling_style_reads_like_rope_parameters(tiny_llama, tmp_path):
    new = copy_checkpoint(tiny_llama, tmp_path / "new")
    edit_config(new, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    old = copy_checkpoint(tiny_llama, tmp_path / "old")
    edit_config(old, rope_parameters=None, rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0})
    prompt = long_prompts(384, lengths=(100,))[0]
    assert load(old).model_config.rope == load(new).model_config.rope
    assert (
        load(old).generate([prompt], GREEDY)[0].token_ids == load(new).generate([prompt], GREEDY)[0].token_ids
    )
