"""The GGUF importer, checked against transformers' own GGUF loading and, where transformers departs
from llama.cpp, against llama.cpp's rules written out by hand.

Every test builds tiny real GGUF files (tests/helpers/tiny_gguf.py); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from libs.engine.models.gguf import GGUFImportError, import_gguf
from tests.helpers.tiny_gguf import (
    SPECIALS,
    USER_DEFINED,
    TinyGGUF,
    train_sentencepiece_vocab,
    write_tiny_gguf,
)

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's 12 o'clock, we'll see.",
    "def f(x):\n    return x * 2\n\n",
    "tabs\tand  double  spaces   end  ",
    "naïve café 東京 🚀✨",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a <think> b",
    "",
]
requires_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="transformers loads a GGUF model only with accelerate installed (add it to the dev extra)",
)


@dataclass
class Converted:
    case: str
    tiny: TinyGGUF
    out: Path


CASES = {
    "smollm-tied": {"pre": "smollm", "tied": True},
    "llama3-untied": {"pre": "llama-bpe", "tied": False, "add_bos": True},
    "sentencepiece": {"tokenizer": "llama", "tied": False, "add_bos": True},
}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory) -> Converted:
    root = tmp_path_factory.mktemp(request.param)
    tiny = write_tiny_gguf(root / "tiny.gguf", **CASES[request.param])
    return Converted(request.param, tiny, import_gguf(tiny.path, root / "hf"))


@pytest.fixture(scope="module")
def smollm(tmp_path_factory) -> Converted:
    root = tmp_path_factory.mktemp("smollm")
    tiny = write_tiny_gguf(root / "tiny.gguf", pre="smollm")
    return Converted("smollm", tiny, import_gguf(tiny.path, root / "hf"))


def reference_model(tiny: TinyGGUF):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name)


def reference_tokenizer(tiny: TinyGGUF):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name)


# --- weights -------------------------------------------------------------------------------------


@requires_accelerate
def test_every_tensor_equals_transformers_gguf_loading(converted):
    ours = load_file(converted.out / "model.safetensors")
    state = reference_model(converted.tiny).state_dict()
    reference = {name: tensor.numpy() for name, tensor in state.items()}
    tied = "lm_head.weight" not in converted.tiny.source
    assert set(reference) - set(ours) == ({"lm_head.weight"} if tied else set())
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == np.float32, name
        np.testing.assert_array_equal(tensor, reference[name], err_msg=name)


def test_float32_q_and_k_rows_are_unpermuted_exactly(smollm):
    ours = load_file(smollm.out / "model.safetensors")
    for part in ("q_proj", "k_proj"):
        name = f"model.layers.1.self_attn.{part}.weight"
        np.testing.assert_array_equal(ours[name], smollm.tiny.source[name])


def test_quantized_tensors_are_close_to_their_source(smollm):
    ours = load_file(smollm.out / "model.safetensors")
    assert set(ours) == set(smollm.tiny.source)
    for name, source in smollm.tiny.source.items():
        assert ours[name].shape == source.shape, name
        # Q4 keeps 16 levels per block of 32 values: the error stays within one step (about 0.05 here).
        np.testing.assert_allclose(ours[name], source, atol=0.1, err_msg=name)


def test_lm_head_is_written_only_when_the_gguf_has_output_weight(tmp_path):
    untied = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    out = import_gguf(untied.path, tmp_path / "untied")
    assert "lm_head.weight" in load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


@requires_accelerate
def test_directory_gives_the_same_logits_as_transformers_gguf_loading(converted):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(converted.out).eval()
    reference = reference_model(converted.tiny).eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 250, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=0)


# --- config --------------------------------------------------------------------------------------


def test_config_fields_equal_transformers_gguf_config(converted):
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(converted.out)
    reference = AutoConfig.from_pretrained(converted.tiny.path.parent, gguf_file=converted.tiny.path.name)
    for name in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(ours, name) == getattr(reference, name), name
    # GGUF stores float32; we write the shortest decimal that round-trips (1e-05), so compare as float32.
    assert np.float32(ours.rms_norm_eps) == np.float32(reference.rms_norm_eps)
    assert ours.rope_parameters["rope_theta"] == reference.rope_parameters["rope_theta"]


def test_config_json_declares_a_float32_llama_without_biases(smollm):
    config = json.loads((smollm.out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert (config["attention_bias"], config["mlp_bias"], config["hidden_act"]) == (False, False, "silu")
    assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-05, 10000.0)
    assert "rope_scaling" not in config


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 2.0,
                "llama.rope.scaling.original_context_length": 128,
            },
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
    ],
)
def test_rope_scaling_is_written_and_loads_in_transformers(tmp_path, kv, expected):
    from transformers import AutoConfig

    tiny = write_tiny_gguf(tmp_path / "scaled.gguf", kv=kv)
    out = import_gguf(tiny.path, tmp_path / "scaled")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == expected
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == expected["rope_type"]


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_encodings_equal_transformers_gguf_tokenizer(converted):
    from transformers import AutoTokenizer

    ours, reference = AutoTokenizer.from_pretrained(converted.out), reference_tokenizer(converted.tiny)
    for text in STRINGS:
        if converted.case == "sentencepiece" and ("<|" in text or "<think>" in text):
            continue  # not in this vocabulary
        if converted.case == "smollm-tied" and any(char.isdigit() for char in text):
            continue  # transformers ignores the smollm digit rule; test_smollm_splits_every_digit_on_its_own
        assert ours.encode(text) == reference.encode(text), repr(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == reference.decode(
            reference.encode(text), skip_special_tokens=False
        ), repr(text)


def test_smollm_splits_every_digit_on_its_own(smollm):
    # transformers' GGUF loader has no rule for the "smollm" pre type and falls back to the GPT-2
    # split, which keeps digit runs together and then applies this vocabulary's digit merges. llama.cpp
    # (and SmolLM2's own tokenizer.json) split every digit first, so the expectation is written by hand.
    tokenizer = Tokenizer.from_file(str(smollm.out / "tokenizer.json"))
    assert any(len(token) > 1 and token.isdigit() for token in tokenizer.get_vocab()), "want digit merges"
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]
    # The digits are cut off first, so the two spaces before them stay one piece ("Ġ", "Ġ12" in GPT-2).
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("x  12")]
    assert pieces == ["x", "ĠĠ", "1", "2"]
    for text in ("It's 12 o'clock", "pi = 3.14159", "1234567890"):
        pieces = tokenizer.encode(text).tokens
        assert all(len(piece) == 1 for piece in pieces if any(c.isdigit() for c in piece)), pieces


def test_llama3_pre_tokenizer_groups_digits_by_three(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "l3.gguf", pre="llama-bpe")
    tokenizer = Tokenizer.from_file(str(import_gguf(tiny.path, tmp_path / "l3") / "tokenizer.json"))
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("1234567 I'M here")]
    assert pieces == ["123", "456", "7", "ĠI", "'M", "Ġhere"]


def test_default_pre_type_follows_llama_cpp_default_regexes(tmp_path):
    # llama.cpp's "default" BPE pre-tokenizer isolates punctuation runs, then applies the GPT-2 split,
    # then cuts digit runs in threes; transformers' GGUF loader uses the plain GPT-2 split instead.
    tiny = write_tiny_gguf(tmp_path / "default.gguf", pre="default")
    tokenizer = Tokenizer.from_file(str(import_gguf(tiny.path, tmp_path / "default") / "tokenizer.json"))
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("it's 12345!")]
    assert pieces == ["it", "'", "s", "Ġ", "123", "45", "!"]


def test_sentencepiece_keeps_a_leading_space_like_llama_cpp(tmp_path):
    # llama.cpp (like sentencepiece and the Llama 2 tokenizer.json) prepends "▁" to the text and after
    # each special token even when one is already there; transformers' GGUF loader uses a Metaspace
    # that skips it when the text starts with a space, so this is checked by hand.
    tiny = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer="llama", add_bos=True)
    tokenizer = Tokenizer.from_file(str(import_gguf(tiny.path, tmp_path / "spm") / "tokenizer.json"))
    assert tokenizer.normalizer.normalize_str(" hello world") == "▁▁hello▁world"
    encoding = tokenizer.encode("hi</s>there")
    assert encoding.tokens[0] == "<s>"
    assert encoding.tokens[encoding.tokens.index("</s>") + 1].startswith("▁")
    assert tokenizer.decode(tokenizer.encode("naïve ☕ café").ids) == "naïve ☕ café"


def llama_cpp_spm_encode(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece algorithm, written out for the test: "▁" for spaces and one in front,
    then join the adjacent pair that forms the best-scoring token (leftmost on ties) until none does,
    then bytes for whatever piece is not a token. BOS first."""
    ids = {token: token_id for token_id, token in enumerate(tokens)}
    symbols = list("▁" + text.replace(" ", "▁"))
    while True:
        pairs = enumerate(itertools.pairwise(symbols))
        candidates = [(-scores[ids[a + b]], i) for i, (a, b) in pairs if a + b in ids]
        if not candidates:
            break
        _, i = min(candidates)
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    encoded = [ids["<s>"]]
    for symbol in symbols:
        encoded += [ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()]
    return encoded


def test_sentencepiece_encodings_equal_llama_cpp_algorithm(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer="llama", add_bos=True)
    tokenizer = Tokenizer.from_file(str(import_gguf(tiny.path, tmp_path / "spm") / "tokenizer.json"))
    tokens, scores, _ = train_sentencepiece_vocab()
    for text in [*STRINGS[:6], " leading space", "  two", "trailing  ", "東京 naïve", "hello\n\nworld"]:
        assert tokenizer.encode(text).ids == llama_cpp_spm_encode(text, tokens, scores), repr(text)


def test_control_and_user_defined_tokens_stay_whole(smollm):
    tokenizer = Tokenizer.from_file(str(smollm.out / "tokenizer.json"))
    encoding = tokenizer.encode("<|im_start|>user\nthink: <think>yes<|im_end|>")
    assert encoding.ids[0] == 1 and encoding.tokens[0] == "<|im_start|>"
    assert "<think>" in encoding.tokens and "<|im_end|>" in encoding.tokens
    added = {token.content: token.special for token in tokenizer.get_added_tokens_decoder().values()}
    assert added == {**dict.fromkeys(SPECIALS, True), USER_DEFINED: False}


def test_tokenizer_config_names_the_special_tokens_and_the_chat_template(smollm):
    from transformers import AutoTokenizer

    config = json.loads((smollm.out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, False)
    assert config["model_max_length"] == 256
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokenizer = AutoTokenizer.from_pretrained(smollm.out)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"
    generation = json.loads((smollm.out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_the_files_recommended_sampling_and_the_callers_go_into_generation_config(tmp_path):
    """llama.cpp's general.sampling.* keys become generation_config.json's sampling values (what
    the engine reports and the router tunes with); `sampling` adds what the file lacks."""
    from libs.engine.models.generation_config import sampling_defaults

    kv = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.05}
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", kv=kv)
    out = import_gguf(tiny.path, tmp_path / "hf", sampling={"top_p": 0.9})
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["top_k"], generation["top_p"]) == (2, 20, 0.9)
    assert sampling_defaults(out) == {
        "temperature": pytest.approx(0.7),
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": pytest.approx(1.05),
    }


def test_add_bos_token_puts_bos_first(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted.out)
    add_bos = CASES[converted.case].get("add_bos", False)
    assert (tokenizer.encode("hello")[0] == 1) is add_bos


# --- errors and publishing -----------------------------------------------------------------------


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFImportError, match=r"GGUF file not found: .*absent\.gguf"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_non_gguf_file_is_refused(tmp_path):
    (tmp_path / "notes.gguf").write_text("hello")
    with pytest.raises(GGUFImportError, match="is not a GGUF file"):
        import_gguf(tmp_path / "notes.gguf", tmp_path / "out")


def test_unsupported_architecture_is_named(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "qwen.gguf", architecture="qwen2")
    with pytest.raises(GGUFImportError, match="unsupported architecture 'qwen2'"):
        import_gguf(tiny.path, tmp_path / "out")


def test_existing_output_directory_needs_overwrite(smollm, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(smollm.tiny.path, tmp_path / "out")
    import_gguf(smollm.tiny.path, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pre": "qwen2"}, "unsupported pre-tokenizer type 'qwen2'"),
        ({"extra_tensors": ("rope_freqs.weight",)}, "rope_freqs.weight"),
        ({"extra_tensors": ("blk.0.ffn_gate_inp.weight",)}, "unsupported tensor 'blk.0.ffn_gate_inp.weight'"),
        ({"float64_norm": True}, r"unsupported tensor type F64 \(tensor 'output_norm.weight'\)"),
        (
            {"kv": {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}},
            "unsupported rope scaling type 'longrope'",
        ),
        (
            {"kv": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0}},
            "missing metadata key 'llama.rope.scaling.original_context_length'",
        ),
    ],
)
def test_what_cannot_be_represented_is_refused_by_name(tmp_path, options, message):
    tiny = write_tiny_gguf(tmp_path / "odd.gguf", **options)
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(tiny.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tokenizer_model_is_named(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "t5.gguf", tokenizer="t5")
    with pytest.raises(GGUFImportError, match="unsupported tokenizer model 't5'"):
        import_gguf(tiny.path, tmp_path / "out")


def test_interrupted_conversion_leaves_no_directory(smollm, tmp_path, monkeypatch):
    from libs.engine.models.gguf import importer

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "_write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(smollm.tiny.path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
