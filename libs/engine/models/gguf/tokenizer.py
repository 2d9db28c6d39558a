"""tokenizer.json and tokenizer_config.json: the `tokenizers` equivalent of llama.cpp's tokenizer for the
file's `tokenizer.ggml.model` and `tokenizer.ggml.pre` types."""

from __future__ import annotations

from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from libs.engine.models.gguf.reader import GGUFImportError, Metadata

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied one after the other; each splits
# every piece the previous ones produced, keeping matches and the text between them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_LLAMA3_PRE_TYPES = ("llama-bpe", "llama3", "llama-v3")
_SUPPORTED_PRE_TYPES = ("default", "gpt-2", "gpt2", "smollm", *_LLAMA3_PRE_TYPES)
_SPIECE_SPACE = "\u2581"


def build_tokenizer(meta: Metadata) -> tuple[Tokenizer, dict[str, Any]]:
    """The `tokenizers` equivalent of llama.cpp's tokenizer for this file, and tokenizer_config.json."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if kind == "gpt2":
        pre_type = meta.get("tokenizer.ggml.pre", "default")  # llama.cpp falls back to its default too
        tokenizer = _byte_level_bpe(meta, tokens, pre_type)
        add_bos_default, clean_spaces = pre_type in _LLAMA3_PRE_TYPES, pre_type != "smollm"
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens)
        add_bos_default, clean_spaces = True, False
    else:
        raise GGUFImportError(
            f"unsupported tokenizer model {kind!r} (tokenizer.ggml.model); "
            "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )
    _register_added_tokens(tokenizer, tokens, types)

    special = {
        name: _token(meta, tokens, key)
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
        )
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = _template_processor(meta, tokens, add_bos, add_eos)
    if kind == "gpt2":
        byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
        tokenizer.post_processor = processors.Sequence([byte_level, template]) if template else byte_level
    elif template is not None:
        tokenizer.post_processor = template

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{name}_token": value for name, value in special.items()},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": clean_spaces,
        "model_max_length": meta.get_int("llama.context_length"),
    }
    if meta.has("tokenizer.chat_template"):
        config["chat_template"] = meta.get("tokenizer.chat_template")
    return tokenizer, config


def _byte_level_bpe(meta: Metadata, tokens: list[str], pre_type: str) -> Tokenizer:
    if pre_type not in _SUPPORTED_PRE_TYPES:
        raise GGUFImportError(
            f"unsupported pre-tokenizer type {pre_type!r} (tokenizer.ggml.pre); "
            f"supported: {', '.join(_SUPPORTED_PRE_TYPES)}"
        )
    merges = []
    for merge in meta.get("tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise GGUFImportError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        merges.append((pair[0], pair[1]))
    # llama.cpp takes a Llama 3 word whole when it is in the vocabulary, before trying merges.
    model = _bpe_model(_vocab(tokens), merges, ignore_merges=pre_type in _LLAMA3_PRE_TYPES)
    tokenizer = Tokenizer(model)
    if pre_type == "smollm":
        # What llama.cpp does for smollm (every digit alone, then the GPT-2 regex) and what
        # SmolLM2's own tokenizer.json says.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre_type in ("gpt-2", "gpt2"):
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        splits = (_LLAMA3_SPLIT,) if pre_type in _LLAMA3_PRE_TYPES else _DEFAULT_SPLITS
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: Metadata, tokens: list[str]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise GGUFImportError("tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length")
    unk = _token(meta, tokens, "unknown_token_id")
    model = _bpe_model(
        _vocab(tokens), _merges_from_scores(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tokenizer = Tokenizer(model)
    # llama.cpp turns spaces into "▁" and, by default, puts one in front of the text and after every
    # special token: a normalizer does exactly that per piece (a Metaspace pre-tokenizer would skip the
    # extra "▁" when the text already starts with a space).
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPIECE_SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE), replace]) if add_prefix else replace
    )
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """llama.cpp's SentencePiece tokenizer joins the adjacent pair whose concatenation is the vocabulary
    token with the best score; a BPE model does the same with every split of every token as a merge,
    ranked by that token's score (ties, rare in real vocabularies, go by token id)."""
    ids = _vocab(tokens)
    ranked = []
    for token_id, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _vocab(tokens: list[str]) -> dict[str, int]:
    # A text listed twice keeps its last id, as in llama.cpp's text-to-token map.
    return {token: token_id for token_id, token in enumerate(tokens)}


def _bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **options)
    except Exception as exc:  # tokenizers raises a bare Exception for merges outside the vocabulary
        raise GGUFImportError(f"the GGUF vocabulary and merges do not form a BPE model: {exc}") from exc


def _register_added_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added tokens:
    llama.cpp matches both whole in the text instead of cutting them into pieces."""
    typed = list(zip(tokens, types, strict=True))
    special = {TokenType.CONTROL, TokenType.UNKNOWN}
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, kind in typed if kind in special]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in typed
            if kind == TokenType.USER_DEFINED
        ]
    )


def _template_processor(
    meta: Metadata, tokens: list[str], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing | None:
    """BOS/EOS around every sequence, as llama.cpp adds them when the file asks for it."""
    wanted = [key for key, on in (("bos_token_id", add_bos), ("eos_token_id", add_eos)) if on]
    if not wanted:
        return None
    ids = {key: meta.get_int(f"tokenizer.ggml.{key}") for key in wanted}
    bos = [tokens[ids["bos_token_id"]]] if add_bos else []
    eos = [tokens[ids["eos_token_id"]]] if add_eos else []
    return processors.TemplateProcessing(
        single=[*bos, "$A:0", *eos],
        pair=[*bos, "$A:0", *eos, *[f"{t}:1" for t in bos], "$B:1", *[f"{t}:1" for t in eos]],
        special_tokens=[(tokens[token_id], token_id) for token_id in ids.values()],
    )


def _token(meta: Metadata, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}", None)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise GGUFImportError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
    return tokens[token_id]
