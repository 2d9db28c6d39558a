"""Tiny real tokenizers for the text-layer tests, trained in-process and saved as HF checkpoint dirs.

Two families cover what the engine meets in practice: a byte-level BPE (GPT-2 / Qwen / SmolLM2 style,
where one character can span several tokens) and a SentencePiece-style BPE with "▁" word marks and
byte fallback (Llama-2 style, where the decoder strips the first leading space). Nothing is
downloaded; each builder writes tokenizer.json, tokenizer_config.json and the generation files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Accents, CJK and emoji make sure some characters need several tokens (and bytes) to decode.
CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you doing today?",
    "Le café est très bon, merci beaucoup. À bientôt, garçon naïve.",
    "Über den Wolken muß die Freiheit wohl grenzenlos sein. Ärger, Öl, Straße.",
    "El niño comió piñata en la mañana. ¿Dónde está? ¡Olé!",
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本测试，你好世界。我们喜欢学习。",
    "한국어 문장도 있습니다. 안녕하세요!",
    "Emoji time: 😀 🎉 👍🏽 ❤️ 🚀 and 🇫🇷 flags.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Numbers 0123456789 and symbols !@#$%^&*()[]{}<>;:'\",./?\\|`~-_=+",
    "Ελληνικά γράμματα: αβγδε. Русский текст: привет мир.",
    "   leading spaces, trailing spaces   \n\ttabs\tand\nnew lines\n",
]
CORPUS = CORPUS_LINES * 4

SAMPLE_TEXTS = [
    "",
    "Hello world",
    " Hello world",
    "Hello  world  ",
    "The café was très naïve.",
    "日本語のテキスト",
    "中文测试 and English",
    "Emoji 😀🎉👍🏽 mixed ❤️ in",
    "🇫🇷🚀",
    "line one\nline two\n\n  indented\ttab",
    "def add(a, b):\n    return a + b",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text with <|endoftext|> inside",
    "Straße Ärger Öl ñ ¿? ¡!",
    "Ελληνικά привет 한국어",
    "unseen zebra xylophone qwerty 🦄",
]

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def train_byte_level_bpe(vocab_size: int = 420) -> Tokenizer:
    """A byte-level BPE (ByteLevel pre-tokenizer and decoder) with ChatML special tokens at ids 0-2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def train_sentencepiece_bpe(vocab_size: int = 360) -> Tokenizer:
    """A Llama-2-style BPE: "▁" word marks, byte fallback for unseen characters, "<s>" prepended on encode."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # A small alphabet leaves CJK and emoji to the byte-fallback tokens, like a real SentencePiece model.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, limit_alphabet=70, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer=trainer)
    model_json = json.loads(trained.to_str())["model"]

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in sorted(model_json["vocab"], key=model_json["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


def save_checkpoint_dir(
    directory: Path,
    tokenizer: Tokenizer,
    tokenizer_config: dict[str, Any] | None,
    *,
    generation_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    chat_template_file: str | None = None,
) -> Path:
    """Write an HF-style checkpoint directory holding only the text-side files the engine reads."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if tokenizer_config is not None:
        _write_json(directory / "tokenizer_config.json", tokenizer_config)
    if generation_config is not None:
        _write_json(directory / "generation_config.json", generation_config)
    if model_config is not None:
        _write_json(directory / "config.json", model_config)
    if chat_template_file is not None:
        (directory / "chat_template.jinja").write_text(chat_template_file, encoding="utf-8")
    return directory


def build_byte_level_dir(directory: Path, **overrides: Any) -> Path:
    """A SmolLM2-like checkpoint: byte-level BPE, ChatML template, eos from three sources."""
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": SMOLLM2_TEMPLATE,
    }
    config.update(overrides)
    return save_checkpoint_dir(
        directory,
        train_byte_level_bpe(),
        config,
        generation_config={"bos_token_id": 1, "eos_token_id": [2, 0]},
        model_config={"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2},
    )


def build_sentencepiece_dir(directory: Path, **overrides: Any) -> Path:
    """A Llama-2-like checkpoint: "▁" BPE with byte fallback, bos added by the post-processor."""
    config: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": {
            "__type": "AddedToken",
            "content": "<s>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA2_TEMPLATE,
    }
    config.update(overrides)
    return save_checkpoint_dir(
        directory,
        train_sentencepiece_bpe(),
        config,
        generation_config={"bos_token_id": 1, "eos_token_id": 2},
        model_config={"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2},
    )
