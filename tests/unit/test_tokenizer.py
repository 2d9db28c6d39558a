"""The engine's Tokenizer gives the same ids, text and special tokens as transformers on the same files."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from libs.engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError
from tests.helpers.tokenizer_fixtures import (
    SAMPLE_TEXTS,
    build_byte_level_dir,
    build_sentencepiece_dir,
    save_checkpoint_dir,
    train_byte_level_bpe,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def _reference(directory: Path):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def checkpoint(request, tmp_path_factory) -> Path:
    build = build_byte_level_dir if request.param == "byte_level" else build_sentencepiece_dir
    return build(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def pair(checkpoint):
    return Tokenizer.from_dir(checkpoint), _reference(checkpoint)


def _added_token(content: str, **flags) -> dict:
    token = {"content": content, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    token["special"] = True
    token.update(flags)
    return token


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    ours, ref = pair
    for text in SAMPLE_TEXTS:
        assert ours.encode(text, add_special_tokens) == ref.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens):
    ours, ref = pair
    sequences = [ref.encode(text) for text in SAMPLE_TEXTS]
    rng = random.Random(0)
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(50)]
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens) == ref.decode(
            ids, skip_special_tokens=skip_special_tokens
        )


def test_decode_skips_special_tokens_by_default(pair):
    ours, _ = pair
    ids = ours.encode("Hello world")
    assert ours.decode([*ids, ours.eos_token_id]) == ours.decode(ids, skip_special_tokens=True)


def test_convert_ids_to_tokens_matches_transformers(pair):
    ours, ref = pair
    ids = ours.encode("Emoji 😀 and café <|im_end|>")
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_special_token_ids_match_transformers(pair):
    ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.all_special_ids == ref.all_special_ids


def test_control_token_ids_are_the_eos_ids_and_every_special_token(pair):
    ours, ref = pair
    special_added = {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert ours.control_token_ids == ours.eos_token_ids | set(ref.all_special_ids) | special_added
    assert ours.eos_token_ids <= ours.control_token_ids and special_added


def test_a_generation_config_eos_that_is_not_special_is_a_control_token_too(tmp_path):
    directory = build_byte_level_dir(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 300]}))
    assert 300 in Tokenizer.from_dir(directory).control_token_ids


def test_token_bytes_of_a_byte_level_vocabulary_concatenate_to_the_decoded_text(tmp_path):
    ours = Tokenizer.from_dir(build_byte_level_dir(tmp_path))
    rng = random.Random(5)
    for _ in range(100):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            data = b"".join(ours.token_bytes(i, skip) for i in ids)
            assert data.decode("utf-8", errors="replace") == ours.decode(ids, skip_special_tokens=skip)


def test_token_bytes_of_a_byte_fallback_vocabulary_are_its_byte_tokens_only(tmp_path):
    tokenizer = Tokenizer.from_dir(build_sentencepiece_dir(tmp_path))
    byte_e4 = tokenizer.backend.token_to_id("<0xE4>")
    assert tokenizer.token_bytes(byte_e4) == b"\xe4"
    assert tokenizer.token_bytes(tokenizer.encode("Hello", add_special_tokens=False)[0]) is None
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b""  # skipped when decoding
    assert tokenizer.token_bytes(tokenizer.eos_token_id, skip_special_tokens=False) is None


def test_stop_ids_are_the_union_of_every_declared_eos(tmp_path):
    directory = build_byte_level_dir(tmp_path, eos_token="<|endoftext|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.eos_token_id == 0
    assert tokenizer.eos_token_ids == frozenset({0, 1, 2})


def test_stop_ids_fall_back_to_the_tokenizer_eos(tmp_path):
    directory = save_checkpoint_dir(tmp_path, train_byte_level_bpe(), {"eos_token": "<|im_end|>"})
    assert Tokenizer.from_dir(directory).eos_token_ids == frozenset({2})


def test_post_processor_alone_decides_bos_and_eos_like_transformers(tmp_path):
    # transformers v5 drops add_bos_token/add_eos_token whenever tokenizer.json exists.
    byte_level = build_byte_level_dir(tmp_path / "b", add_bos_token=True, add_eos_token=True)
    sentencepiece = build_sentencepiece_dir(tmp_path / "s", add_bos_token=False, add_eos_token=True)
    for directory in (byte_level, sentencepiece):
        ours, ref = Tokenizer.from_dir(directory), _reference(directory)
        assert ours.encode("Hello world") == ref.encode("Hello world")
    assert Tokenizer.from_dir(sentencepiece).encode("Hi")[0] == 1


def test_config_added_tokens_and_extra_special_tokens_match_transformers(tmp_path):
    directory = build_byte_level_dir(
        tmp_path,
        added_tokens_decoder={
            "0": _added_token("<|endoftext|>"),
            "2": _added_token("<|im_end|>", rstrip=True),
            "500": _added_token("<tool>", special=False),
            "501": _added_token("<think>"),
        },
        mask_token="<mask>",
        image_token={
            "__type": "AddedToken",
            "content": "<image>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        },
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<extra>"],
    )
    ours, ref = Tokenizer.from_dir(directory), _reference(directory)
    text = "Hi<|im_end|>  there <tool> x<think>y <extra><mask><image>"
    assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    assert ours.vocab_size == len(ref)
    assert ours.all_special_ids == ref.all_special_ids


def test_special_tokens_map_json_is_read_when_the_config_has_no_added_tokens(tmp_path):
    directory = save_checkpoint_dir(tmp_path, train_byte_level_bpe(), {"model_max_length": 512})
    special_tokens_map = {
        "eos_token": {
            "content": "<|im_end|>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        },
        "pad_token": "<pad>",
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    ours, ref = Tokenizer.from_dir(directory), _reference(directory)
    assert (ours.eos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.pad_token_id) == (2, 420)
    assert ours.all_special_ids == ref.all_special_ids


def test_split_special_tokens_matches_transformers(tmp_path):
    directory = build_byte_level_dir(tmp_path, split_special_tokens=True)
    ours, ref = Tokenizer.from_dir(directory), _reference(directory)
    assert ours.encode("<|im_start|>user") == ref.encode("<|im_start|>user")
    assert 1 not in ours.encode("<|im_start|>user")


def test_clean_up_tokenization_spaces_is_ignored_for_bpe_like_transformers(tmp_path):
    directory = build_byte_level_dir(tmp_path, clean_up_tokenization_spaces=True)
    ours, ref = Tokenizer.from_dir(directory), _reference(directory)
    ids = ours.encode("Hello , world . Yes !")
    assert ours.decode(ids) == ref.decode(ids) == "Hello , world . Yes !"


def test_truncation_baked_into_tokenizer_json_is_disabled(tmp_path):
    backend = train_byte_level_bpe()
    backend.enable_truncation(max_length=3)
    tokenizer = Tokenizer.from_dir(save_checkpoint_dir(tmp_path, backend, {}))
    assert len(tokenizer.encode("Hello world, how are you doing today?")) > 3


def test_chat_template_file_wins_over_the_config(tmp_path):
    directory = build_byte_level_dir(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(directory).chat_template == "{{ messages[0]['content'] }}!"


def test_named_chat_templates_use_default(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    tokenizer = Tokenizer.from_dir(build_byte_level_dir(tmp_path, chat_template=templates))
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.chat_template == "plain"
    assert tokenizer.apply_chat_template(messages) == "plain"
    assert tokenizer.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools"


def test_named_chat_templates_without_default_list_the_names(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "rag", "template": "rag"}]
    tokenizer = Tokenizer.from_dir(build_byte_level_dir(tmp_path, chat_template=templates))
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="no 'default' template among rag, tool_use"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_a_broken_chat_template_fails_at_use_not_at_load(tmp_path):
    tokenizer = Tokenizer.from_dir(build_byte_level_dir(tmp_path, chat_template="{% for m in messages %}"))
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello")
    with pytest.raises(ChatTemplateError, match="invalid Jinja"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_missing_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_unreadable_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot be loaded"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_config_names_the_file(tmp_path):
    directory = build_byte_level_dir(tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not readable JSON"):
        Tokenizer.from_dir(directory)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"eos_token": 7}, "tokenizer_config.json: eos_token"),
        (
            {"bos_token": {"__type": "AddedToken", "content": None}},
            "tokenizer_config.json: bos_token.content",
        ),
        ({"chat_template": 3}, "tokenizer_config.json: chat_template"),
        ({"chat_template": [{"name": "default"}]}, r"tokenizer_config.json: chat_template\[0\]"),
        ({"added_tokens_decoder": {"5": 3}}, "tokenizer_config.json: added_tokens_decoder.5"),
        ({"added_tokens_decoder": {"x": {"content": "a"}}}, "tokenizer_config.json: added_tokens_decoder.x"),
        ({"added_tokens_decoder": {"5": {"content": "a", "lstrip": "yes"}}}, "added_tokens_decoder.5"),
        ({"extra_special_tokens": "<x>"}, "tokenizer_config.json: extra_special_tokens"),
        ({"split_special_tokens": "no"}, "tokenizer_config.json: split_special_tokens"),
    ],
)
def test_bad_config_fields_are_named(tmp_path, overrides, field):
    with pytest.raises(TokenizerError, match=field):
        Tokenizer.from_dir(build_byte_level_dir(tmp_path, **overrides))


def test_bad_eos_token_id_names_the_file_and_field(tmp_path):
    directory = build_byte_level_dir(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(TokenizerError, match=r"generation_config\.json: eos_token_id"):
        Tokenizer.from_dir(directory)


def test_tokenizer_error_is_a_value_error():
    assert issubclass(TokenizerError, ValueError)


def test_encoding_a_short_prompt_is_fast(pair):
    ours, _ = pair
    ours.encode("warm up")
    start = time.perf_counter()
    for _ in range(2000):
        ours.encode("<|im_start|>user\nHello there, how are you?<|im_end|>\n")
    # A single Rust call is ~10 µs; rebuilding anything per call would cost milliseconds.
    assert (time.perf_counter() - start) / 2000 < 1e-3


@pytest.mark.default_model
def test_the_default_model_tokenizer_matches_transformers(default_model):
    ours, ref = Tokenizer.from_dir(default_model), _reference(default_model)
    for text in SAMPLE_TEXTS:
        for add_special_tokens in (True, False):
            assert ours.encode(text, add_special_tokens) == ref.encode(
                text, add_special_tokens=add_special_tokens
            )
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(30)]
        assert ours.decode(ids, False) == ref.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "Hi 😀"}, {"role": "assistant", "content": "Hello!"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (ours.vocab_size, ours.all_special_ids) == (len(ref), ref.all_special_ids)
    assert ref.eos_token_id in ours.eos_token_ids
